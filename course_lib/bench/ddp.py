"""Step time of NaiveDDP, FlatDDP, our DDP and torch's DistributedDataParallel,
side by side in one job, plus compute only (no gradient sync) and the overlap
fraction of our DDP read from a traced step; and a bucket-size sweep.

A step is zero_grad, forward, MSE loss, backward (with synchronisation), SGD
step, on a deep MLP. Times are the slowest rank's mean per step, median over
rounds in which the variants alternate.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from course_lib import trace
from course_lib.runtime.backend import current_device
from course_lib.runtime.device import sync
from course_lib.data import regression_batch
from course_lib.ddp import DDP, FlatDDP, NaiveDDP
from course_lib.models import deep_mlp


class _Plain(torch.nn.Module):
    """The model with no synchronisation at all: the compute-only baseline."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def _net(width, depth, device):
    return deep_mlp(width, depth, inputs=width, outputs=width).to(device)


def _torch_ddp(module, device, bucket_mb):
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, bucket_cap_mb=bucket_mb)


def _variants(width, depth, bucket_mb, device):
    return {
        "compute only": _Plain(_net(width, depth, device)),
        "NaiveDDP": NaiveDDP(_net(width, depth, device)),
        "FlatDDP": FlatDDP(_net(width, depth, device)),
        "DDP (ours)": DDP(_net(width, depth, device), bucket_cap_mb=bucket_mb),
        "torch DDP": _torch_ddp(_net(width, depth, device), device, bucket_mb),
    }


def _step(model, opt, x, y):
    opt.zero_grad(set_to_none=False)
    F.mse_loss(model(x), y).backward()
    opt.step()


def _time_steps(model, opt, x, y, steps, device):
    """Mean seconds per step on the slowest rank, bracketed by device syncs."""
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, opt, x, y)
    sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / steps], device=device,
                           dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _batch(width, batch, device):
    x, _ = regression_batch(batch, inputs=width, outputs=1, seed=dist.get_rank())
    return x.to(device), torch.zeros(batch, width, device=device)


@trace.paused()
def measure(width=1024, depth=8, batch=64, bucket_mb=25.0, steps=5, rounds=3, warmup=2):
    """{variant: seconds per step}, on every rank (run it under the launcher)."""
    device = current_device()
    x, y = _batch(width, batch, device)
    models = _variants(width, depth, bucket_mb, device)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    for name, model in models.items():
        for _ in range(warmup):
            _step(model, opts[name], x, y)
    samples = {k: [] for k in models}
    for _ in range(rounds):
        for name, model in models.items():
            samples[name].append(_time_steps(model, opts[name], x, y, steps, device))
    return {k: statistics.median(v) for k, v in samples.items()}


def _library_ddp(module, bucket_cap_mb):
    return DDP(module, bucket_cap_mb=bucket_cap_mb)


def traced_overlap(width=1024, depth=8, batch=64, bucket_mb=25.0, make_ddp=None):
    """One traced step of a DDP (``make_ddp(module, bucket_cap_mb)``, ours by
    default, the student's in Lab 02): forward, backward's gradient computation
    and each bucket's all-reduce. Returns the number of buckets."""
    device = current_device()
    x, y = _batch(width, batch, device)
    net = _net(width, depth, device)
    trace.trace_backward(net)
    model = (make_ddp or _library_ddp)(net, bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with trace.paused():
        for _ in range(2):  # the second step runs on buckets rebuilt in ready order
            _step(model, opt, x, y)
    dist.barrier()
    with trace.span("forward", "compute"):
        loss = F.mse_loss(model(x), y)
    loss.backward()
    return len(model.buckets)


@trace.paused()
def bucket_sweep(bucket_mbs, width=1024, depth=8, batch=64, steps=5, rounds=3, make_ddp=None):
    """{bucket_mb: (ours, torch)} seconds per step; "ours" is ``make_ddp``'s."""
    device = current_device()
    x, y = _batch(width, batch, device)
    result = {}
    for cap in bucket_mbs:
        pair = {"ours": (make_ddp or _library_ddp)(_net(width, depth, device), cap),
                "torch": _torch_ddp(_net(width, depth, device), device, cap)}
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in pair.items()}
        for k, m in pair.items():
            for _ in range(2):
                _step(m, opts[k], x, y)
        samples = {k: [] for k in pair}
        for _ in range(rounds):
            for k, m in pair.items():
                samples[k].append(_time_steps(m, opts[k], x, y, steps, device))
        result[cap] = (statistics.median(samples["ours"]), statistics.median(samples["torch"]))
    return result


@trace.paused()
def overlap_versus_buckets(width=1024, depth=8, batch=64, bucket_mb=4.0, steps=5, rounds=3):
    """The 2x2 experiment: {after backward, during backward} x {one tensor per
    all-reduce, buckets of ``bucket_mb``}, all our DDP, alternating in one job.
    Returns {(when, grouping): seconds per step}, plus ("compute only", "")."""
    device = current_device()
    x, y = _batch(width, batch, device)
    one_tensor = 2**-20  # one byte: every tensor closes its own bucket
    models = {("compute only", ""): _Plain(_net(width, depth, device))}
    for when, overlap in (("after backward", False), ("during backward", True)):
        for grouping, cap in (("one tensor", one_tensor), ("buckets", bucket_mb)):
            models[(when, grouping)] = DDP(_net(width, depth, device), bucket_cap_mb=cap,
                                           overlap=overlap)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    for k, m in models.items():
        for _ in range(2):
            _step(m, opts[k], x, y)
    samples = {k: [] for k in models}
    for _ in range(rounds):
        for k, m in models.items():
            samples[k].append(_time_steps(m, opts[k], x, y, steps, device))
    return {k: statistics.median(v) for k, v in samples.items()}


def profiled_step(path, width=1024, depth=8, batch=64, bucket_mb=4.0):
    """One DDP step under ``torch.profiler`` (after two warm-up steps); rank 0
    writes the profiler's Chrome trace to ``path`` and returns its table of the
    most expensive operators, other ranks return None."""
    from torch.profiler import ProfilerActivity, profile

    device = current_device()
    x, y = _batch(width, batch, device)
    model = DDP(_net(width, depth, device), bucket_cap_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(2):
        _step(model, opt, x, y)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _step(model, opt, x, y)
        sync(device)
    if dist.get_rank() != 0:
        return None
    prof.export_chrome_trace(path)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=8)


def format_tables(times, sweep, overlap, nproc, bucket_mb):
    torch_t = times["torch DDP"]
    lines = [f"DDP step time on {nproc} ranks, bucket_cap_mb={bucket_mb:g}:",
             f"{'variant':>14} {'ms/step':>9} {'vs torch DDP':>13}"]
    for name, t in times.items():
        lines.append(f"{name:>14} {t * 1e3:>9.1f} {t / torch_t:>13.2f}")
    lines.append(f"overlap of our bucket all-reduces with backward: {overlap:.0%}")
    lines.append("")
    lines.append(f"{'bucket MB':>10} {'ours ms':>9} {'torch ms':>9} {'ratio':>6}")
    for cap, (ours, theirs) in sweep.items():
        lines.append(f"{cap:>10g} {ours * 1e3:>9.1f} {theirs * 1e3:>9.1f} {ours / theirs:>6.2f}")
    return "\n".join(lines)
