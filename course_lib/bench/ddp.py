"""Step time of NaiveDDP, FlatDDP, our DDP and torch's DistributedDataParallel,
side by side in one job, plus compute only (no gradient sync) and the overlap
fraction of our DDP read from a traced step; a bucket-size sweep; and what our
per-parameter hooks cost, with no collective at all (:mod:`~course_lib.bench.ddp_hooks`).

A step is zero_grad, forward, loss, backward (with synchronisation), SGD step,
on a deep MLP (MSE loss) or, with ``model="gpt2-small"``, on the course's GPT at
GPT-2 small's shape (cross-entropy on random tokens). Times are the slowest
rank's mean per step, median over rounds in which the variants alternate.
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
from course_lib.models import GPT, GPTConfig, deep_mlp, gpt_param_count


class _Plain(torch.nn.Module):
    """The model with no synchronisation at all: the compute-only baseline."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


MODELS = ("mlp", "gpt2-small")
# GPT-2 small's shape with GPT-2's vocabulary. The course's GPT has an untied output
# layer with a bias, so this is 163.06M parameters in 138 tensors (GPT-2's 124M,
# which ties the output layer to the token embedding, plus 50257 x 769).
GPT2_SMALL = dict(vocab=50257, dim=768, layers=12, heads=12, seq_len=1024)


class _Workload:
    """What a step trains: ``net(device)`` builds a fresh model (the same weights
    every time), ``data(device)`` this rank's batch (x, y), ``loss(out, y)``.

    "mlp": :func:`deep_mlp` of ``width`` x ``depth`` on ``batch`` rows, MSE loss.
    "gpt2-small": :data:`GPT2_SMALL` on ``batch`` sequences of ``seq`` random tokens
    (1024 by default; the position table keeps 1024 rows whatever ``seq``, so the
    parameters do not change with it), cross-entropy; ``width``/``depth`` unused.
    ``gpt``: GPTConfig fields that replace GPT-2 small's (the tests shrink it)."""

    def __init__(self, model="mlp", width=1024, depth=8, batch=64, seq=None, gpt=None):
        if model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {model!r}")
        self.model, self.width, self.depth, self.batch = model, width, depth, batch
        if model == "gpt2-small":
            shape = {**GPT2_SMALL, **(gpt or {})}
            self.seq = shape["seq_len"] if seq is None else seq
            self.config = GPTConfig(**{**shape, "seq_len": max(shape["seq_len"], self.seq)})
            self.loss = _token_loss
        else:
            self.seq, self.config, self.loss = None, None, F.mse_loss

    def net(self, device):
        if self.config is None:
            return _net(self.width, self.depth, device)
        return GPT(self.config, seed=0).to(device)

    def data(self, device):
        if self.config is None:
            return _batch(self.width, self.batch, device)
        gen = torch.Generator(device="cpu").manual_seed(dist.get_rank())
        tokens = torch.randint(self.config.vocab, (self.batch, self.seq + 1), generator=gen,
                               device="cpu")
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _token_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _net(width, depth, device):
    return deep_mlp(width, depth, inputs=width, outputs=width).to(device)


def _torch_ddp(module, device, bucket_mb):
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, bucket_cap_mb=bucket_mb)


def _variants(work, bucket_mb, device):
    """The MLP gets every variant; GPT-2 small only compute, ours and torch's (NaiveDDP
    and FlatDDP teach on the MLP, and five copies of 163M parameters are a lot of memory)."""
    variants = {"compute only": _Plain,
                "NaiveDDP": NaiveDDP,
                "FlatDDP": FlatDDP,
                "DDP (ours)": lambda net: DDP(net, bucket_cap_mb=bucket_mb),
                "torch DDP": lambda net: _torch_ddp(net, device, bucket_mb)}
    if work.model != "mlp":
        del variants["NaiveDDP"], variants["FlatDDP"]
    return {name: wrap(work.net(device)) for name, wrap in variants.items()}


def _step(model, opt, x, y, loss_fn=F.mse_loss):
    opt.zero_grad(set_to_none=False)
    loss_fn(model(x), y).backward()
    opt.step()


def _time_steps(model, opt, x, y, steps, device, loss_fn=F.mse_loss):
    """Mean seconds per step on the slowest rank, bracketed by device syncs."""
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, opt, x, y, loss_fn)
    sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / steps], device=device,
                           dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _batch(width, batch, device):
    x, _ = regression_batch(batch, inputs=width, outputs=1, seed=dist.get_rank())
    return x.to(device), torch.zeros(batch, width, device=device)


@trace.paused()
def measure(width=1024, depth=8, batch=64, bucket_mb=25.0, steps=5, rounds=3, warmup=2,
            model="mlp", seq=None, gpt=None):
    """{variant: seconds per step}, on every rank (run it under the launcher)."""
    device = current_device()
    work = _Workload(model, width, depth, batch, seq, gpt)
    x, y = work.data(device)
    models = _variants(work, bucket_mb, device)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    for name, net in models.items():
        for _ in range(warmup):
            _step(net, opts[name], x, y, work.loss)
    samples = {k: [] for k in models}
    for _ in range(rounds):
        for name, net in models.items():
            samples[name].append(_time_steps(net, opts[name], x, y, steps, device, work.loss))
    return {k: statistics.median(v) for k, v in samples.items()}


def _library_ddp(module, bucket_cap_mb):
    return DDP(module, bucket_cap_mb=bucket_cap_mb)


def traced_overlap(width=1024, depth=8, batch=64, bucket_mb=25.0, make_ddp=None, model="mlp",
                   seq=None, gpt=None):
    """One traced step of a DDP (``make_ddp(module, bucket_cap_mb)``, ours by
    default, the student's in Lab 02): forward, backward's gradient computation
    and each bucket's all-reduce. Returns the number of buckets."""
    device = current_device()
    work = _Workload(model, width, depth, batch, seq, gpt)
    x, y = work.data(device)
    net = work.net(device)
    trace.trace_backward(net)
    ddp = (make_ddp or _library_ddp)(net, bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    with trace.paused():
        for _ in range(2):  # the second step runs on buckets rebuilt in ready order
            _step(ddp, opt, x, y, work.loss)
    dist.barrier()
    with trace.span("forward", "compute"):
        loss = work.loss(ddp(x), y)
    loss.backward()
    return len(ddp.buckets)


@trace.paused()
def bucket_sweep(bucket_mbs, width=1024, depth=8, batch=64, steps=5, rounds=3, make_ddp=None,
                 model="mlp", seq=None, gpt=None):
    """{bucket_mb: (ours, torch)} seconds per step; "ours" is ``make_ddp``'s."""
    device = current_device()
    work = _Workload(model, width, depth, batch, seq, gpt)
    x, y = work.data(device)
    result = {}
    for cap in bucket_mbs:
        pair = {"ours": (make_ddp or _library_ddp)(work.net(device), cap),
                "torch": _torch_ddp(work.net(device), device, cap)}
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in pair.items()}
        for k, m in pair.items():
            for _ in range(2):
                _step(m, opts[k], x, y, work.loss)
        samples = {k: [] for k in pair}
        for _ in range(rounds):
            for k, m in pair.items():
                samples[k].append(_time_steps(m, opts[k], x, y, steps, device, work.loss))
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


def describe(model="mlp", width=1024, depth=8, batch=64, seq=None, gpt=None):
    """One line: the model, its parameters and tensors, the batch of each rank."""
    work = _Workload(model, width, depth, batch, seq, gpt)
    if work.config is None:
        params = width * width * (depth + 1) + width * (depth + 1)
        return (f"mlp {width} x {depth} + 1 ({params / 1e6:.1f}M parameters, "
                f"{2 * (depth + 1)} tensors), batch {batch} per rank")
    c = work.config
    return (f"gpt2-small, the course's GPT: {c.layers} layers, dim {c.dim}, {c.heads} heads, "
            f"vocab {c.vocab}, untied head ({gpt_param_count(c) / 1e6:.1f}M parameters, "
            f"{11 * c.layers + 6} tensors), batch {batch} x {work.seq} tokens per rank")


def format_tables(times, sweep, overlap, nproc, bucket_mb):
    torch_t = times["torch DDP"]
    lines = [f"DDP step time on {nproc} ranks, bucket_cap_mb={bucket_mb:g}:",
             f"{'variant':>14} {'ms/step':>9} {'vs torch DDP':>13}"]
    for name, t in times.items():
        lines.append(f"{name:>14} {t * 1e3:>9.1f} {t / torch_t:>13.2f}")
    lines.append(f"overlap of our bucket all-reduces with backward: {overlap:.0%}")
    if not sweep:
        return "\n".join(lines)
    lines.append("")
    lines.append(f"{'bucket MB':>10} {'ours ms':>9} {'torch ms':>9} {'ratio':>6}")
    for cap, (ours, theirs) in sweep.items():
        lines.append(f"{cap:>10g} {ours * 1e3:>9.1f} {theirs * 1e3:>9.1f} {ours / theirs:>6.2f}")
    return "\n".join(lines)
