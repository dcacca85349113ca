"""Every from-scratch collective on sub-groups: the rows and columns of a device mesh.

4 ranks as dp=2 x tp=2, 6 ranks as dp=2 x tp=3 and dp=3 x tp=2 (gloo). On each
rank's dp group and tp group, each collective must equal torch's collective on
the same group, with roots named by their group-local rank; the counters must
name only group-local peers; operations in flight on two groups at once must
not disturb each other.
"""
import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import collectives as C
from course_lib import comm, run
from course_lib.mesh import ParallelDims
from course_lib.runtime.backend import builtin_all_gather, builtin_reduce_scatter

ship_by_value(__name__)


def _compare(name, got, want, problems):
    if not torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-5):
        problems.append(f"{name}: {got.flatten()[:4].tolist()} != {want.flatten()[:4].tolist()}")


def every_collective_on(group, numel, problems, label):
    rank, size = dist.get_rank(), dist.get_world_size(group)
    root = size - 1  # group-local: the last member, never global rank 0's alias
    x = torch.arange(numel, dtype=torch.float32) * (rank + 1) + rank

    for name, ours, theirs in [
        ("all_reduce", lambda t: C.all_reduce(t, group=group),
         lambda t: dist.all_reduce(t, group=group)),
        ("naive_all_reduce", lambda t: C.naive_all_reduce(t, root=root, group=group),
         lambda t: dist.all_reduce(t, group=group)),
        ("broadcast", lambda t: C.broadcast(t, root, group=group),
         lambda t: dist.broadcast(t, group=group, group_src=root)),
        ("pipelined_broadcast", lambda t: C.pipelined_broadcast(t, root, 3, group=group),
         lambda t: dist.broadcast(t, group=group, group_src=root)),
    ]:
        got, want = x.clone(), x.clone()
        with comm.counting() as stats:
            ours(got)
        theirs(want)
        _compare(f"{label} {name}", got, want, problems)
        peers = set(stats.sent_to) | set(stats.recv_from)
        if not peers <= set(range(size)) - {dist.get_rank(group)}:
            problems.append(f"{label} {name}: peers {sorted(peers)} are not group-local")

    got, want = x.clone(), x.clone()
    C.reduce(got, root, group=group)
    dist.reduce(want, group=group, group_dst=root)
    if dist.get_rank(group) == root:
        _compare(f"{label} reduce", got, want, problems)

    inp = torch.arange(size * numel, dtype=torch.float32) + 100 * rank
    got, want = torch.empty(numel), torch.empty(numel)
    C.reduce_scatter(got, inp, group=group)
    builtin_reduce_scatter(want, inp, group=group)
    _compare(f"{label} reduce_scatter", got, want, problems)

    got, want = torch.empty(size * numel), torch.empty(size * numel)
    C.all_gather(got, x, group=group)
    builtin_all_gather(want, x, group=group)
    _compare(f"{label} all_gather", got, want, problems)


def on_a_mesh(dp, tp, numel):
    dims = ParallelDims(dp=dp, tp=tp)
    dims.build()
    problems = []
    for dim in ("dp", "tp"):
        every_collective_on(dims.group(dim), numel, problems, f"{dim} of {dims}")

    # Two operations in flight at once, on different groups: each has its own buffers.
    rank = dist.get_rank()
    a = torch.arange(4 * numel, dtype=torch.float32) + rank
    b = torch.arange(4 * numel, dtype=torch.float32) * -1.0 - rank
    want_a, want_b = a.clone(), b.clone()
    dist.all_reduce(want_a, group=dims.group("dp"))
    dist.all_reduce(want_b, group=dims.group("tp"))
    handle_a = C.all_reduce(a, group=dims.group("dp"), async_op=True)
    handle_b = C.all_reduce(b, group=dims.group("tp"), async_op=True)
    handle_b.wait()
    handle_a.wait()
    _compare("async dp", a, want_a, problems)
    _compare("async tp", b, want_b, problems)
    dims.destroy()
    return problems


@pytest.mark.parametrize("world,dp,tp", [(4, 2, 2), (6, 2, 3), (6, 3, 2)])
def test_collectives_on_mesh_rows_and_columns_equal_torch(world, dp, tp):
    # 1001 elements: no group size divides it, and the ring pipelines segments
    problems = run(on_a_mesh, dp, tp, 1001, nproc=world, backend="gloo", timeout=300)
    assert problems == [[]] * world


def lab00_patterns_on_a_sub_group():
    from course_lib.collectives import p2p

    rank = dist.get_rank()
    # odd and even global ranks: group rank r of {1, 3, 5} is global rank 2r + 1
    groups = [dist.new_group([0, 2, 4]), dist.new_group([1, 3, 5])]
    group = groups[rank % 2]
    token = p2p.token_ring(torch.tensor([float(rank)]), group=group)
    shifted = p2p.ring_shift(torch.tensor([float(rank)]), group=group)
    echoed, times = p2p.ping_pong(torch.tensor([float(rank)]), 2, group=group)
    return token.item(), shifted.item(), None if echoed is None else echoed.item(), len(times)


def test_lab00_patterns_run_on_a_sub_group():
    outs = run(lab00_patterns_on_a_sub_group, nproc=6, backend="gloo", timeout=120)
    for rank, (token, shifted, echoed, n_times) in enumerate(outs):
        me, members = rank // 2, [rank % 2 + 2 * r for r in range(3)]
        # the token started at group rank 0 (global members[0]) and each group rank r added r
        expected_token = members[0] + (3 if me == 0 else sum(range(1, me + 1)))
        assert token == expected_token
        assert shifted == members[(me - 1) % 3]
        assert echoed == (members[0] if me in (0, 1) else None)
        assert n_times == (2 if me == 0 else 0)
