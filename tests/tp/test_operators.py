"""f, g, split and gather under real torchrun (gloo): values, input gradients and
the collectives each runs, forward and backward, on groups of t = 1, 2, 3 ranks."""
import pytest
import torch
import torch.distributed as dist

import tp_helpers as H
from conftest import ship_by_value
from course_lib import run

ship_by_value(__name__)
ship_by_value("tp_helpers")

WORLD = 3
SHAPE = (3, 5, 6)  # a batch of 3, a sequence of 5, 6 features: 6 splits by 1, 2 and 3
KINDS = ("torch", "ring")


def _counted(fn):
    from course_lib import comm

    with comm.counting() as stats:
        out = fn()
    return out, dict(stats.collectives), dict(stats.collective_bytes)


def all_operator_cases():
    from course_lib import tp

    rank = dist.get_rank()
    out = {}
    for t in (1, 2, 3):
        group = H.tp_group(t)
        size, me = dist.get_world_size(group), dist.get_rank(group)
        for kind in KINDS:
            case = {}
            x = H.seeded(1, *SHAPE).requires_grad_()
            y, case["f_fwd"], _ = _counted(lambda: tp.copy_to_tp(x, group, kind))
            _, case["f_bwd"], case["f_bwd_bytes"] = _counted(
                lambda: (y * H.seeded(100 + me, *SHAPE)).sum().backward())
            case["f"] = (y.detach(), x.grad)

            x = H.seeded(200 + me, *SHAPE).requires_grad_()
            y, case["g_fwd"], case["g_fwd_bytes"] = _counted(
                lambda: tp.reduce_from_tp(x, group, kind))
            _, case["g_bwd"], _ = _counted(lambda: (y * H.seeded(2, *SHAPE)).sum().backward())
            case["g"] = (y.detach(), x.grad)

            x = H.seeded(3, *SHAPE).requires_grad_()
            y, case["split_fwd"], _ = _counted(lambda: tp.split_to_tp(x, group, kind))
            local = (*SHAPE[:-1], SHAPE[-1] // size)
            _, case["split_bwd"], case["split_bwd_bytes"] = _counted(
                lambda: (y * H.seeded(300 + me, *local)).sum().backward())
            case["split"] = (y.detach(), x.grad)

            x = H.seeded(400 + me, *SHAPE[:-1], 2).requires_grad_()
            y, case["gather_fwd"], case["gather_fwd_bytes"] = _counted(
                lambda: tp.gather_from_tp(x, group, kind))
            _, case["gather_bwd"], _ = _counted(
                lambda: (y * H.seeded(4, *SHAPE[:-1], 2 * size)).sum().backward())
            case["gather"] = (y.detach(), x.grad)
            out[t, kind] = (size, me, case)
        try:
            tp.split_to_tp(torch.zeros(3, 5), group)
            out[t, "uneven"] = None
        except ValueError as exc:
            out[t, "uneven"] = str(exc)
    pair = dist.new_group([0, 1])
    try:
        tp.copy_to_tp(torch.zeros(2), pair)
        out["outsider"] = None
    except ValueError as exc:
        out["outsider"] = str(exc)
    return rank, out


@pytest.fixture(scope="module")
def results():
    return run(all_operator_cases, nproc=WORLD, timeout=120)


def _groups(t):
    """For every global rank: (first rank of its group, size of its group)."""
    owner = {}
    for start, size in H.group_sizes(t, WORLD):
        for r in range(start, start + size):
            owner[r] = (start, size)
    return owner


def _each_case():
    return [(t, kind) for t in (1, 2, 3) for kind in KINDS]


@pytest.mark.parametrize("t,kind", _each_case())
def test_f_is_identity_forward_and_all_reduce_backward(results, t, kind):
    for rank, out in results:
        size, me, case = out[t, kind]
        y, dx = case["f"]
        assert torch.equal(y, H.seeded(1, *SHAPE))
        want = sum(H.seeded(100 + r, *SHAPE) for r in range(size))
        torch.testing.assert_close(dx, want, rtol=1e-6, atol=1e-6)
        assert case["f_fwd"] == {}
        if size > 1:
            assert case["f_bwd"] == {"all_reduce": 1}
            assert case["f_bwd_bytes"] == {"all_reduce": 4 * 3 * 5 * 6}
        else:
            assert case["f_bwd"] == {}  # t = 1: nothing to communicate


@pytest.mark.parametrize("t,kind", _each_case())
def test_g_is_all_reduce_forward_and_identity_backward(results, t, kind):
    for rank, out in results:
        size, me, case = out[t, kind]
        y, dx = case["g"]
        torch.testing.assert_close(y, sum(H.seeded(200 + r, *SHAPE) for r in range(size)),
                                   rtol=1e-6, atol=1e-6)
        assert torch.equal(dx, H.seeded(2, *SHAPE))  # not t times it
        assert case["g_bwd"] == {}
        if size > 1:
            assert case["g_fwd"] == {"all_reduce": 1}
            assert case["g_fwd_bytes"] == {"all_reduce": 4 * 3 * 5 * 6}


@pytest.mark.parametrize("t,kind", _each_case())
def test_split_and_gather_are_conjugate_along_the_last_dim(results, t, kind):
    for rank, out in results:
        size, me, case = out[t, kind]
        y, dx = case["split"]
        assert torch.equal(y, H.seeded(3, *SHAPE).chunk(size, -1)[me])
        width = SHAPE[-1] // size
        assert torch.equal(dx, torch.cat([H.seeded(300 + r, *SHAPE[:-1], width)
                                          for r in range(size)], -1))
        y, dx = case["gather"]
        blocks = [H.seeded(400 + r, *SHAPE[:-1], 2) for r in range(size)]
        assert torch.equal(y, torch.cat(blocks, -1))
        assert torch.equal(dx, H.seeded(4, *SHAPE[:-1], 2 * size).chunk(size, -1)[me])
        assert case["split_fwd"] == {} and case["gather_bwd"] == {}
        if size > 1:
            assert case["split_bwd_bytes"] == {"all_gather": 4 * 3 * 5 * 6}
            assert case["gather_fwd_bytes"] == {"all_gather": 4 * 3 * 5 * 2 * size}


def test_a_last_dim_that_does_not_divide_is_a_value_error_with_the_sizes(results):
    for rank, out in results:
        assert out[1, "uneven"] is None
        for t in (2, 3):
            size = _groups(t)[rank][1]
            if size == 1:
                assert out[t, "uneven"] is None
            else:
                assert "= 5" in out[t, "uneven"] and f"t = {size}" in out[t, "uneven"]


def test_a_rank_outside_the_group_is_refused(results):
    for rank, out in results:
        assert (out["outsider"] is None) == (rank in (0, 1))
        if rank == 2:
            assert "not a member" in out["outsider"]
