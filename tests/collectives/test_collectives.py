"""From-scratch collectives against torch's built-ins, under real torchrun (gloo).

World sizes 1 to 8; sizes 0, 1, primes and sizes not divisible by the world
size; float32/float64/bfloat16/int64; SUM, AVG, MAX, MIN, PRODUCT. Integers and
MAX/MIN must match exactly. Float sums are compared "to rounding": the ring adds
in a different order than gloo, so the tolerance is K rounding errors of the
largest summand (K x eps(dtype) x max|x|).
"""
import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import collectives as C
from course_lib import comm, run
from course_lib.runtime.backend import builtin_all_gather, builtin_reduce_scatter

ship_by_value(__name__)

OPS = [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN,
       dist.ReduceOp.PRODUCT]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]


def sample(numel, dtype, gen, op):
    if dtype == torch.int64:
        return torch.randint(-3 if op == dist.ReduceOp.PRODUCT else -50, 4, (numel,), generator=gen)
    low = 0.5 if op == dist.ReduceOp.PRODUCT else -2.0  # keep products well scaled
    return (torch.rand(numel, generator=gen, dtype=torch.float64) * 1.5 + low).to(dtype)


def compare(got, want, inputs_max, world, dtype, op, where):
    exact = dtype == torch.int64 or op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN)
    if exact:
        if not torch.equal(got, want):
            return f"{where}: {got[:6].tolist()} != {want[:6].tolist()}"
        return None
    eps = torch.finfo(dtype).eps
    scale = inputs_max ** world if op == dist.ReduceOp.PRODUCT else inputs_max
    try:
        torch.testing.assert_close(got, want, rtol=world * eps * 4,
                                   atol=float(world * eps * 4 * max(scale, 1.0)))
    except AssertionError as exc:
        return f"{where}: {str(exc).splitlines()[2:4]}"
    return None


def all_reduce_matrix(sizes, dtypes, ops):
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234 + rank)
    problems = []
    for numel in sizes:
        for dtype in dtypes:
            for op in ops:
                if op == dist.ReduceOp.AVG and dtype == torch.int64:
                    continue
                x = sample(numel, dtype, gen, op)
                peak = torch.tensor([x.abs().max().item() if numel else 0.0])
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                want = x.clone()
                dist.all_reduce(want, op=op)
                for fn in (C.all_reduce, C.naive_all_reduce):
                    got = x.clone()
                    fn(got, op)
                    problem = compare(got, want, peak.item(), world, dtype, op,
                                      f"{fn.__name__} n={numel} {dtype} {op}")
                    if problem:
                        problems.append(problem)
                if numel:  # reduce to a root that is not 0 when there is one
                    dst = world - 1
                    got = x.clone()
                    C.reduce(got, dst, op)
                    if rank == dst:
                        problem = compare(got, want, peak.item(), world, dtype, op,
                                          f"reduce n={numel} {dtype} {op}")
                        if problem:
                            problems.append(problem)
                    elif not torch.equal(got, x):
                        problems.append(f"reduce changed the tensor of non-root rank {rank}")
    return problems


FULL_SIZES = [0, 1, 2, 7, 13, 64, 1001]


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_and_reduce_match_torch_everywhere(world):
    problems = run(all_reduce_matrix, FULL_SIZES, DTYPES, OPS, nproc=world, timeout=300)
    assert problems == [[]] * world


@pytest.mark.parametrize("world", [1, pytest.param(4, marks=pytest.mark.slow),
                                   pytest.param(5, marks=pytest.mark.slow),
                                   pytest.param(8, marks=pytest.mark.slow)])
def test_all_reduce_other_world_sizes(world):
    problems = run(all_reduce_matrix, [0, 1, world + 1, 997], [torch.float32, torch.int64],
                   [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT],
                   nproc=world, timeout=300)
    assert problems == [[]] * world


def one_to_all_and_scatter_gather(sizes):
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(99 + rank)
    problems = []
    for numel in sizes:
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            x = (torch.arange(numel) * (rank + 1)).to(dtype)
            for src in sorted({0, world - 1}):
                want = x.clone()
                dist.broadcast(want, src)
                for name, fn in (("broadcast", lambda t: C.broadcast(t, src)),
                                 ("ring_broadcast", lambda t: C.ring_broadcast(t, src)),
                                 ("pipelined_broadcast/3", lambda t: C.pipelined_broadcast(t, src, 3)),
                                 ("pipelined_broadcast/50", lambda t: C.pipelined_broadcast(t, src, 50))):
                    got = x.clone()
                    fn(got)
                    if not torch.equal(got, want):
                        problems.append(f"{name} n={numel} {dtype} src={src}")
            inp = torch.randn(world * numel, generator=gen).to(dtype) if dtype != torch.int64 \
                else torch.randint(-9, 9, (world * numel,), generator=gen)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                got, want = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
                C.reduce_scatter(got, inp, op)
                builtin_reduce_scatter(want, inp, op=op)
                tol = {} if dtype != torch.bfloat16 else {"rtol": 0.05, "atol": 0.05 * world}
                if op == dist.ReduceOp.MAX or dtype == torch.int64:
                    ok = torch.equal(got, want)
                else:
                    ok = torch.allclose(got.double(), want.double(), **(tol or {"rtol": 1e-5, "atol": 1e-6}))
                if not ok:
                    problems.append(f"reduce_scatter n={numel} {dtype} {op}")
            small = torch.full((numel,), rank, dtype=dtype)
            got, want = torch.empty(world * numel, dtype=dtype), torch.empty(world * numel, dtype=dtype)
            C.all_gather(got, small)
            builtin_all_gather(want, small)
            if not torch.equal(got, want):
                problems.append(f"all_gather n={numel} {dtype}")
    return problems


@pytest.mark.parametrize("world", [1, 2, 3, pytest.param(5, marks=pytest.mark.slow)])
def test_broadcast_reduce_scatter_all_gather_match_torch(world):
    problems = run(one_to_all_and_scatter_gather, [0, 1, 7, 1000], nproc=world, timeout=300)
    assert problems == [[]] * world


def non_contiguous_and_shaped():
    rank = dist.get_rank()
    base = torch.arange(24.0).reshape(4, 6) + rank
    x = base.t()  # not contiguous
    want = x.clone()
    dist.all_reduce(want)
    C.all_reduce(x)
    scalar = torch.tensor(float(rank + 1))
    C.all_reduce(scalar, dist.ReduceOp.PRODUCT)
    return torch.equal(x, want), torch.equal(base.t(), x), scalar.item()


def test_shapes_and_non_contiguous_tensors_are_reduced_in_place():
    outs = run(non_contiguous_and_shaped, nproc=3)
    assert outs == [(True, True, 6.0)] * 3


def counted(fn_name, numel, segments=None):
    world = dist.get_world_size()
    with comm.counting() as stats:
        if fn_name == "all_reduce":
            C.all_reduce(torch.ones(numel))
        elif fn_name == "naive_all_reduce":
            C.naive_all_reduce(torch.ones(numel))
        elif fn_name == "reduce_scatter":
            C.reduce_scatter(torch.empty(numel // world), torch.ones(numel))
        elif fn_name == "all_gather":
            C.all_gather(torch.empty(numel), torch.ones(numel // world))
        elif fn_name == "pipelined_broadcast":
            C.pipelined_broadcast(torch.ones(numel), 0, segments)
    return stats.sent_messages, stats.sent_bytes, stats.recv_messages, stats.recv_bytes


@pytest.mark.parametrize("world,numel", [(2, 1000), (3, 1000), (4, 1003),
                                         pytest.param(5, 12, marks=pytest.mark.slow)])
def test_ring_all_reduce_sends_2_n_minus_1_chunks(world, numel):
    nbytes = 4 * numel
    for msgs, sent, rmsgs, received in run(counted, "all_reduce", numel, nproc=world):
        assert msgs == rmsgs == 2 * (world - 1)
        # 2(n-1)/n of the tensor, up to chunk rounding (each chunk ceil or floor of N/n)
        assert abs(sent - 2 * (world - 1) * nbytes / world) <= 2 * (world - 1) * 4
        assert sent <= 2 * (world - 1) * 4 * -(-numel // world)
        assert received == sent or abs(received - sent) <= 2 * (world - 1) * 4


def segmented(numel, segment_bytes, op):
    from course_lib.collectives import ring

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    want = x.clone()
    dist.all_reduce(want, op=op)
    with comm.counting() as stats:
        C.all_reduce(x, op, segment_bytes=segment_bytes)
    segments = ring.ring_segments(numel, world, x.element_size(), segment_bytes=segment_bytes)
    return torch.allclose(x, want, rtol=1e-12, atol=1e-12), segments, stats.as_dict()


@pytest.mark.parametrize("world,numel", [(2, 1001), (3, 1001), (4, 4099)])
def test_pipelined_ring_sends_the_same_bytes_in_steps_times_segments(world, numel):
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        outs = run(segmented, numel, 200, op, nproc=world, timeout=120)
        for rank, (equal, segments, stats) in enumerate(outs):
            assert equal
            assert 1 < segments <= 16
            assert stats["sent_messages"] == stats["recv_messages"] == 2 * (world - 1) * segments
            # exactly the chunked ring's bytes: 2(n-1)/n of the tensor, up to chunk rounding
            assert abs(stats["sent_bytes"] - 2 * (world - 1) * 8 * numel / world) <= 2 * (world - 1) * 8
            assert set(stats["sent_to"]) == {(rank + 1) % world}  # only to the right
            assert set(stats["recv_from"]) == {(rank - 1) % world}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reduce_scatter_and_all_gather_send_n_minus_1_chunks(world):
    numel = 1200
    for name in ("reduce_scatter", "all_gather"):
        for msgs, sent, rmsgs, received in run(counted, name, numel, nproc=world):
            assert msgs == rmsgs == world - 1
            assert sent == received == (world - 1) * 4 * numel // world


def test_naive_all_reduce_funnels_through_the_root():
    world, numel = 3, 1000
    outs = run(counted, "naive_all_reduce", numel, nproc=world)
    assert outs[0] == (world - 1, (world - 1) * 4 * numel, world - 1, (world - 1) * 4 * numel)
    assert outs[1] == outs[2] == (1, 4 * numel, 1, 4 * numel)


def test_pipelined_broadcast_sends_s_segments_per_hop():
    outs = run(counted, "pipelined_broadcast", 1000, 7, nproc=3)
    assert outs[0] == (7, 4000, 0, 0)  # the root sends, never receives
    assert outs[1] == (7, 4000, 7, 4000)
    assert outs[2] == (0, 0, 7, 4000)  # the last in the chain only receives


def bad_calls():
    errors = []
    world = dist.get_world_size()
    calls = [
        lambda: C.reduce_scatter(torch.empty(3), torch.ones(3 * world + 1)),
        lambda: C.all_gather(torch.empty(5), torch.ones(2)),
        lambda: C.all_gather(torch.empty(2 * world, dtype=torch.float64), torch.ones(2)),
        lambda: C.all_reduce(torch.ones(3, dtype=torch.int64), dist.ReduceOp.AVG),
        lambda: C.broadcast(torch.ones(3), src=world),
        lambda: C.pipelined_broadcast(torch.ones(3), 0, 0),
        lambda: C.all_reduce([1.0, 2.0]),
    ]
    with comm.counting() as stats:
        for call in calls:
            try:
                call()
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
    return errors, stats.sent_messages


def test_impossible_shapes_and_dtypes_raise_before_any_message():
    errors, sent = run(bad_calls, nproc=2)[0]
    assert sent == 0 and None not in errors
    assert "input must have 2 x 3 = 6 elements, it has 7" in errors[0]
    assert "output must have 2 x 2 = 4 elements, it has 5" in errors[1]
    assert "dtype" in errors[2] and "AVG" in errors[3] and "root rank 2" in errors[4]
    assert "segments" in errors[5] and "torch.Tensor" in errors[6]
