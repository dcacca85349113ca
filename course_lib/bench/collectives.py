"""nccl-tests style benchmark of course_lib's collectives against torch's, in one job.

For each size and op both implementations run back to back on the same ranks:
warm-up iterations, then timed ones; a rank's time is the mean per iteration and
the reported time is the slowest rank's. algbw = S/t, busbw = algbw x the
nccl-tests factor (2(n-1)/n all-reduce, (n-1)/n reduce-scatter and all-gather
with S the whole array, 1 broadcast), ratio = our busbw / torch's busbw.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from course_lib import collectives as C
from course_lib import trace
from course_lib.runtime.backend import builtin_all_gather, builtin_reduce_scatter, current_device
from course_lib.runtime.device import sync
from course_lib.collectives.cost_model import bus_factor

# op -> (ours, torch's); each takes (buffers) and runs one collective.
OPS = ("all_reduce", "naive_all_reduce", "reduce_scatter", "all_gather", "broadcast",
       "pipelined_broadcast")
TORCH_NAME = {"all_reduce": "all_reduce", "naive_all_reduce": "all_reduce",
              "reduce_scatter": "reduce_scatter", "all_gather": "all_gather",
              "broadcast": "broadcast", "pipelined_broadcast": "broadcast"}


def parse_size(text):
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    unit = text[-1] if text and text[-1] in units else ""
    return int(float(text[: len(text) - len(unit)]) * units[unit])


def size_range(spec, factor=4):
    """'4K:64M' -> [4096, 16384, ..., 64 MiB] (geometric, like nccl-tests -f)."""
    lo, _, hi = spec.partition(":")
    lo, hi = parse_size(lo), parse_size(hi or lo)
    sizes = []
    while lo <= hi:
        sizes.append(lo)
        lo *= factor
    return sizes


def _buffers(op, nbytes, world, device):
    """(args for ours, args for torch) for a collective moving S = nbytes."""
    numel = max(world, nbytes // 4)
    numel -= numel % world  # reduce-scatter / all-gather need K equal chunks
    big = torch.ones(numel, device=device)
    small = torch.ones(numel // world, device=device)
    if op in ("reduce_scatter",):
        return (small, big), (small.clone(), big.clone())
    if op == "all_gather":
        return (big, small), (big.clone(), small.clone())
    return (big,), (big.clone(),)


def _runner(op, impl, segments):
    if impl == "torch":
        return {"all_reduce": lambda t: dist.all_reduce(t),
                "reduce_scatter": lambda o, i: builtin_reduce_scatter(o, i),
                "all_gather": lambda o, i: builtin_all_gather(o, i),
                "broadcast": lambda t: dist.broadcast(t, 0)}[TORCH_NAME[op]]
    return {"all_reduce": lambda t: C.all_reduce(t),
            "naive_all_reduce": lambda t: C.naive_all_reduce(t),
            "reduce_scatter": lambda o, i: C.reduce_scatter(o, i),
            "all_gather": lambda o, i: C.all_gather(o, i),
            "broadcast": lambda t: C.ring_broadcast(t, 0),
            "pipelined_broadcast": lambda t: C.pipelined_broadcast(t, 0, segments)}[op]


def _time(fn, args, iters, device):
    """Mean seconds per call on the slowest rank, from an idle device to the
    end of the last call's work on it."""
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64,
                           device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _iterations(fn, args, device, target_s, warmup, max_iters):
    for _ in range(warmup):
        fn(*args)
    once = _time(fn, args, 1, device)
    # every rank must run the same number of iterations: take rank 0's estimate
    iters = torch.tensor([int(min(max_iters, max(2, target_s / max(once, 1e-6))))],
                         device=device)
    dist.broadcast(iters, 0)
    return int(iters.item())


def _compare(runners, device, target_s, warmup, max_iters, repeats):
    """Median over ``repeats`` rounds of each runner's mean time; the runners
    alternate within every round so that both see the same machine."""
    iters = {k: _iterations(fn, args, device, target_s / repeats, warmup, max_iters)
             for k, (fn, args) in runners.items()}
    samples = {k: [] for k in runners}
    for _ in range(repeats):
        for k, (fn, args) in runners.items():
            samples[k].append(_time(fn, args, iters[k], device))
    return {k: (statistics.median(v), iters[k] * repeats) for k, v in samples.items()}


@trace.paused()
def measure(sizes, ops, warmup=3, target_s=0.3, max_iters=50, segments=8, repeats=5):
    """Run on every rank; returns a list of row dicts (the same on all ranks)."""
    world, device = dist.get_world_size(), current_device()
    rows = []
    for nbytes in sizes:
        for op in ops:
            ours_args, torch_args = _buffers(op, nbytes, world, device)
            # S is the whole array: reduce-scatter's input, all-gather's output
            whole = max(a.numel() for a in ours_args)
            row = {"op": op, "bytes": whole * 4, "nproc": world}
            runners = {"ours": (_runner(op, "ours", segments), ours_args),
                       "torch": (_runner(op, "torch", segments), torch_args)}
            timed = _compare(runners, device, target_s, warmup, max_iters, repeats)
            for impl, (t, iters) in timed.items():
                algbw = row["bytes"] / t
                row[impl] = {"time_s": t, "iters": iters, "algbw": algbw,
                             "busbw": algbw * bus_factor(TORCH_NAME[op], world)}
            row["ratio"] = row["ours"]["busbw"] / row["torch"]["busbw"]
            rows.append(row)
    return rows


def format_table(rows):
    head = (f"{'size':>10} {'op':>20} | {'ours us':>10} {'algbw':>7} {'busbw':>7} | "
            f"{'torch us':>10} {'algbw':>7} {'busbw':>7} | {'ratio':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        o, t = r["ours"], r["torch"]
        lines.append(f"{_human(r['bytes']):>10} {r['op']:>20} | {o['time_s'] * 1e6:>10.1f} "
                     f"{o['algbw'] / 1e9:>7.3f} {o['busbw'] / 1e9:>7.3f} | "
                     f"{t['time_s'] * 1e6:>10.1f} {t['algbw'] / 1e9:>7.3f} "
                     f"{t['busbw'] / 1e9:>7.3f} | {r['ratio']:>6.2f}")
    lines.append("(bandwidths in GB/s; ratio = our busbw / torch busbw, same job)")
    return "\n".join(lines)


def _human(nbytes):
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


@trace.paused()
def sweep(impls, sizes, warmup=2, target_s=0.2, max_iters=20, repeats=3):
    """Time in-place collectives ``fn(tensor)`` (all-reduce, broadcast...) given as
    ``{label: fn}`` over ``sizes`` in bytes, alternating between them so that they
    share the machine's conditions. Run on every rank; returns
    {label: [(bytes, seconds)]}, each the median of the slowest rank's times."""
    device = current_device()
    result = {label: [] for label in impls}
    for nbytes in sizes:
        runners = {label: (fn, (torch.ones(max(1, nbytes // 4), device=device),))
                   for label, fn in impls.items()}
        timed = _compare(runners, device, target_s, warmup, max_iters, repeats)
        for label, (t, _) in timed.items():
            result[label].append((max(1, nbytes // 4) * 4, t))
    return result
