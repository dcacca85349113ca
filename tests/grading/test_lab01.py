"""Lab 01's checks: the course's own collectives pass them, broken ones fail
with the hint a student needs."""
import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import comm
from course_lib.grading import checks, lab01
from course_lib import collectives as C

ship_by_value(__name__)


def test_reference_collectives_pass_every_check(capsys):
    lab01.check_naive_all_reduce(C.naive_all_reduce)
    lab01.check_ring_reduce_scatter(C.reduce_scatter)
    lab01.check_ring_all_gather(C.all_gather)
    lab01.check_ring_all_reduce(C.all_reduce)
    lab01.check_pipelined_broadcast(C.pipelined_broadcast)
    out = capsys.readouterr().out
    assert [f"✓ Exercise 1.{i} passed" in out for i in range(1, 6)] == [True] * 5


def whole_tensor_ring(tensor, op=dist.ReduceOp.SUM):
    """Right values, (K-1) full-size messages: the classic fake ring."""
    rank, world = dist.get_rank(), dist.get_world_size()
    acc, sending, incoming = tensor.clone(), tensor.clone(), torch.empty_like(tensor)
    for _ in range(world - 1):
        comm.exchange([(sending, (rank + 1) % world)], [(incoming, (rank - 1) % world)])
        C.combine(acc, incoming, op)
        sending = incoming.clone()
    return tensor.copy_(acc)


def sum_ignoring_op(tensor, op=dist.ReduceOp.SUM):
    return C.all_reduce(tensor, dist.ReduceOp.SUM)


def gather_without_own_chunk(output, input):
    C.all_gather(output, input)
    rank, n = dist.get_rank(), input.numel()
    output[rank * n:(rank + 1) * n] = 0
    return output


def broadcast_without_pipelining(tensor, src, segments):
    return C.pipelined_broadcast(tensor, src, 1)


def test_whole_tensor_ring_is_caught_by_its_bytes():
    with pytest.raises(checks.CheckFailed) as info:
        lab01.check_ring_all_reduce(whole_tensor_ring, world_sizes=(3,))
    assert "the whole tensor seems to travel" in str(info.value)


def test_wrong_values_and_wrong_segmenting_are_caught():
    with pytest.raises(checks.CheckFailed, match="op RedOpType.MAX"):
        lab01.check_ring_all_reduce(sum_ignoring_op, world_sizes=(2,))
    with pytest.raises(checks.CheckFailed, match="Exercise 1.3: rank 0 of world size 2"):
        lab01.check_ring_all_gather(gather_without_own_chunk, world_sizes=(2,))
    with pytest.raises(checks.CheckFailed, match=r"S=4: expected \(4, 0\), got \(1, 0\)"):
        lab01.check_pipelined_broadcast(broadcast_without_pipelining, world_sizes=(2,))
