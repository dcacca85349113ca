"""Exercise 1.6's check: the course's star, choice and dispatch pass; a chooser that
ignores latency, a dispatch that always rings, a star that posts one message at a time
and the stubs fail, each with its reason."""
import pytest
import torch
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib import comm
from course_lib.collectives import adaptive_all_reduce, cost_model, ring
from course_lib.collectives.reduce_ops import combine
from course_lib.grading import checks, lab01

ship_by_value(__name__)

SUM = dist.ReduceOp.SUM


def star(tensor, op=SUM, at_once=True):
    rank, world = dist.get_rank(), dist.get_world_size()
    peers = list(range(1, world))
    if world == 1:
        return tensor
    if rank:
        comm.exchange(sends=[(tensor, 0)])
        comm.exchange(recvs=[(tensor, 0)])
        return tensor
    incoming = [torch.empty_like(tensor) for _ in peers]
    if at_once:
        comm.exchange(recvs=list(zip(incoming, peers)))
    else:
        for buf, peer in zip(incoming, peers):
            comm.exchange(recvs=[(buf, peer)])
    for other in incoming:
        combine(tensor, other, op)
    comm.exchange(sends=[(tensor, p) for p in peers])
    return tensor


def choose(n_bytes, k, alpha, bandwidth):
    star_time = 2 * (alpha + (k - 1) * n_bytes / bandwidth)
    ring_time = 2 * (k - 1) * (alpha + n_bytes / (k * bandwidth))
    return "star" if star_time < ring_time else "ring"


def choose_by_bandwidth_only(n_bytes, k, alpha, bandwidth):
    return "ring"


def adaptive(tensor, op, alpha, bandwidth):
    if choose(tensor.numel() * tensor.element_size(), dist.get_world_size(), alpha,
              bandwidth) == "star":
        return star(tensor, op)
    return ring.all_reduce(tensor, op)


def adaptive_always_ring(tensor, op, alpha, bandwidth):
    return ring.all_reduce(tensor, op)


def adaptive_with_a_sequential_star(tensor, op, alpha, bandwidth):
    if choose(tensor.numel() * 4, dist.get_world_size(), alpha, bandwidth) == "star":
        return star(tensor, op, at_once=False)
    return ring.all_reduce(tensor, op)


def test_the_choice_flips_at_the_crossover_and_never_on_two_ranks():
    for k in (3, 4, 8, 64):
        at = cost_model.star_ring_crossover(k, 3e-6, 450e9)
        assert cost_model.choose_all_reduce(at * 0.99, k, 3e-6, 450e9) == "star"
        assert cost_model.choose_all_reduce(at * 1.01, k, 3e-6, 450e9) == "ring"
    assert {cost_model.choose_all_reduce(n, 2, 1e-3, 1e6) for n in (1, 10**9)} == {"ring"}


def test_a_student_style_answer_and_the_library_s_pass(sandbox):
    assert "SUM and MAX" in judged(sandbox, lab01.check_adaptive_all_reduce, choose, adaptive, seed=7)
    lab01.check_adaptive_all_reduce(cost_model.choose_all_reduce, adaptive_all_reduce,
                                    world_sizes=(3,))


@pytest.mark.parametrize("chooser,dispatch,fragment", [
    (choose_by_bandwidth_only, adaptive, "small messages are all latency"),
    (choose, adaptive_always_ring, "should run the star"),
    (choose, adaptive_with_a_sequential_star, "post the root's K-1 receives in one"),
])
def test_wrong_answers_are_named(chooser, dispatch, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab01.check_adaptive_all_reduce, chooser, dispatch, world_sizes=(3,))


def test_the_stubs_say_not_implemented():
    def choose_stub(n_bytes, k, alpha, bandwidth):
        raise NotImplementedError("Exercise 1.6: an all-reduce that picks its algorithm")

    with pytest.raises(NotImplementedError, match="Exercise 1.6 is not implemented"):
        lab01.check_adaptive_all_reduce(choose_stub, adaptive)
