"""Each lab's reference implementations on NCCL, one GPU per rank, against
torch's built-ins computed in the same job (Lab 00, 01) or one CPU process
training on the whole batch (Lab 02).

The graded checks (course_lib.grading.lab00-02) launch on gloo by design, so a
grade does not depend on the machine; this suite runs the same references
through the NCCL code paths (batch_isend_irecv, CUDA tensors, helper threads
on the rank's GPU). Skipped, with the reason, where fewer than 2 GPUs are visible.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import needs_gpus, ship_by_value
from course_lib import collectives as C
from course_lib import run
from course_lib.collectives import p2p
from course_lib.ddp import DDP, FlatDDP, NaiveDDP
from course_lib.grading import lab02
from course_lib.runtime.backend import builtin_all_gather, builtin_reduce_scatter, current_device

ship_by_value(__name__)

GPUS = torch.cuda.device_count()
pytestmark = needs_gpus(2)
# odd world sizes where the machine has the GPUs for them
WORLDS = [2, pytest.param(3, marks=pytest.mark.skipif(GPUS < 3, reason=f"3 ranks need 3 GPUs, "
                                                                       f"torch sees {GPUS}"))]
TIMEOUT = 120


# ---- Lab 00: point-to-point patterns ----------------------------------------------------
def lab00_job():
    rank, device = dist.get_rank(), current_device()
    payload = torch.arange(1001, dtype=torch.float32, device=device)
    echo, times = p2p.ping_pong(payload, 3)
    ring = p2p.token_ring(torch.arange(7, dtype=torch.float64, device=device))
    shifted = p2p.ring_shift(torch.full((100_003,), float(rank), device=device))
    return (None if echo is None else echo.cpu(), times, ring.cpu(), shifted.cpu(),
            str(payload.device), str(torch.get_default_device()))


@pytest.mark.parametrize("nproc", WORLDS)
def test_lab00_patterns_on_nccl(nproc):
    outs = run(lab00_job, nproc=nproc, backend="nccl", timeout=TIMEOUT)
    token = torch.arange(7, dtype=torch.float64)
    for rank, (echo, times, ring, shifted, device, default) in enumerate(outs):
        assert device == default == f"cuda:{rank}"
        if rank == 0:
            assert torch.equal(echo, torch.arange(1001, dtype=torch.float32))
            assert len(times) == 3 and all(t > 0 for t in times)
        added = nproc * (nproc - 1) // 2 if rank == 0 else rank * (rank + 1) // 2
        assert torch.equal(ring, token + added)
        assert torch.equal(shifted, torch.full((100_003,), float((rank - 1) % nproc)))


# ---- Lab 01: collectives from send/recv ---------------------------------------------------
SIZES = (1, 7, 1001, (1 << 18) + 3)  # none divides evenly by 2 or 3 ranks but 1


def _inputs(numel, dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randint(-100, 100, (numel,), generator=gen, device="cpu") if dtype == torch.int64
         else torch.randn(numel, generator=gen, dtype=dtype, device="cpu"))
    return x.to(device)


BROADCASTS = (("broadcast", C.broadcast), ("ring_broadcast", C.ring_broadcast),
              ("pipelined_broadcast", lambda t, src: C.pipelined_broadcast(t, src, 4)))


def lab01_job():
    """Every from-scratch collective next to torch's on the same inputs; returns
    a description of each mismatch (an empty list when all agree)."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), current_device()
    bad = []

    def same(what, got, want):
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * world):
            bad.append(f"rank {rank}: {what}")

    case = 0
    for numel in SIZES:
        for dtype in (torch.float32, torch.int64):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                case += 1
                x = _inputs(numel, dtype, 100 * case + rank, device)
                want = x.clone()
                dist.all_reduce(want, op=op)
                for name, fn in (("all_reduce", C.all_reduce),
                                 ("naive_all_reduce", C.naive_all_reduce)):
                    got = x.clone()
                    fn(got, op)
                    same(f"{name} {numel} {dtype} {op}", got, want)
                got, want = x.clone(), x.clone()
                C.reduce(got, world - 1, op)
                dist.reduce(want, world - 1, op=op)
                if rank == world - 1:
                    same(f"reduce {numel} {dtype} {op}", got, want)
                whole = _inputs(world * numel, dtype, 100 * case + rank, device)
                got, want = torch.empty_like(x), torch.empty_like(x)
                C.reduce_scatter(got, whole, op)
                builtin_reduce_scatter(want, whole, op=op)
                same(f"reduce_scatter {numel} {dtype} {op}", got, want)
            got, want = torch.empty_like(whole), torch.empty_like(whole)
            C.all_gather(got, x)
            builtin_all_gather(want, x)
            same(f"all_gather {numel} {dtype}", got, want)
            for src in sorted({0, world - 1}):
                want = x.clone()
                dist.broadcast(want, src)
                for name, fn in BROADCASTS:
                    got = x.clone()
                    fn(got, src)
                    same(f"{name} {numel} {dtype} from {src}", got, want)
    return bad, case


@pytest.mark.parametrize("nproc", WORLDS)
def test_lab01_collectives_match_torch_on_nccl(nproc):
    outs = run(lab01_job, nproc=nproc, backend="nccl", timeout=TIMEOUT)
    for bad, cases in outs:
        assert cases == len(SIZES) * 4 and bad == []


# ---- Lab 02: data parallelism ---------------------------------------------------------------
WRAPPERS = {"NaiveDDP": NaiveDDP, "FlatDDP": FlatDDP,
            "DDP": lambda m, all_reduce: DDP(m, bucket_cap_mb=0.01, all_reduce=all_reduce)}


def lab02_job(wrapper, all_reduce):
    """Lab 02's training run (ranks start from different weights) on the rank's GPU."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), current_device()
    model = lab02.references.model("mlp", seed=0 if rank == 0 else 1000 + rank).to(device)
    ddp = WRAPPERS[wrapper](model, all_reduce=all_reduce)
    opt = torch.optim.SGD(model.parameters(), lr=lab02.LR)
    x, y = lab02.references.data(world)
    mine = slice(rank * lab02.PER_RANK, (rank + 1) * lab02.PER_RANK)
    x, y = x[mine].to(device), y[mine].to(device)
    for _ in range(lab02.STEPS):
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("wrapper,all_reduce", [("NaiveDDP", "torch"), ("FlatDDP", "torch"),
                                                ("DDP", "torch"), ("DDP", "ring")])
def test_lab02_data_parallel_equals_one_process_on_nccl(wrapper, all_reduce):
    outs = run(lab02_job, wrapper, all_reduce, nproc=2, backend="nccl", timeout=TIMEOUT)
    expected, _ = lab02.references.single_process(2)  # one CPU process, the whole batch
    for params in outs:
        assert len(params) == len(expected)
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def bf16_hook_job(kind):
    """Three steps with bf16 gradient compression: torch's DDP with torch's own
    hook (which it allows only on NCCL), or ours with the library's."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from course_lib.ddp import comm_hooks

    rank, device = dist.get_rank(), current_device()
    model = lab02.references.model("mlp", seed=0).to(device)
    if kind == "torch":
        ddp = DistributedDataParallel(model, device_ids=[device.index], bucket_cap_mb=0.01)
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        ddp = DDP(model, bucket_cap_mb=0.01)
        ddp.register_comm_hook(None, comm_hooks.bf16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lab02.LR)
    x, y = (t[rank * lab02.PER_RANK:(rank + 1) * lab02.PER_RANK].to(device)
            for t in lab02.references.data(dist.get_world_size()))
    for _ in range(lab02.STEPS):
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def test_bf16_compression_hook_as_torch_on_nccl():
    theirs = run(bf16_hook_job, "torch", nproc=2, backend="nccl", timeout=TIMEOUT)
    ours = run(bf16_hook_job, "ours", nproc=2, backend="nccl", timeout=TIMEOUT)
    for mine, ref in zip(ours, theirs):
        for got, want in zip(mine, ref):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
