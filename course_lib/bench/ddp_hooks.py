"""What our DDP's per-parameter hooks cost with no collective at all (Lab 02's bench,
``python -m course_lib.bench ddp``): the same model's backward plain, under our DDP
with its all-reduce replaced by nothing, and under torch DDP with a no-op comm hook,
taking turns step by step; plus the host time inside our hook bodies.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from course_lib import trace
from course_lib.bench.ddp import _Plain, _torch_ddp, _Workload
from course_lib.ddp import DDP
from course_lib.runtime.backend import current_device
from course_lib.runtime.device import sync


def _no_collective(tensor):
    """DDP's all_reduce replaced by nothing: "reduced in place, synchronously" (the
    callable form of ``all_reduce``), so the hooks, buckets and divisions all run."""
    return None


def _torch_no_collective(state, bucket):
    """torch DDP's comm hook replaced by nothing: the bucket comes back as it went."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _timed(fn, total):
    """``fn``, adding the nanoseconds each call takes to ``total[0]``."""
    def timed(*args):
        start = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            total[0] += time.perf_counter_ns() - start
    return timed


def _time_backwards(models, opts, x, y, loss_fn, steps, device, after_each=None):
    """Seconds of each backward, [model][step], on the slowest rank: the forward
    outside the clock, each backward bracketed by device syncs, the models taking
    turns step by step. ``after_each()`` runs after each backward and returns one
    more number per step (a row of its own, also the slowest rank's)."""
    rows = len(models) + (after_each is not None)
    times = torch.zeros(rows, steps, dtype=torch.float64)
    for step in range(steps):
        for i, (net, opt) in enumerate(zip(models, opts)):
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(net(x), y)
            sync(device)
            start = time.perf_counter()
            loss.backward()
            sync(device)
            times[i, step] = time.perf_counter() - start
            opt.step()
        if after_each is not None:
            times[-1, step] = after_each()
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


@trace.paused()
def hook_cost(width=1024, depth=8, batch=64, bucket_mb=25.0, steps=5, rounds=3, warmup=2,
              model="mlp", seq=None, gpt=None):
    """What our DDP's per-parameter hooks cost, communication left out: the backward of
    the same model plain (no hooks), under our DDP with its all-reduce replaced by
    nothing (:func:`_no_collective`: hooks, bucket bookkeeping, the division by K and
    the end-of-backward write-back all run) and under torch DDP with a comm hook that
    returns its bucket untouched (torch's C++ reducer, for comparison). The three take
    turns step by step, ``rounds`` x ``steps`` steps each.

    Returns seconds: ``ours_s``/``torch_s``, the extra backward time per step over the
    plain one (median over steps of the slowest rank's difference: a paired median, as
    the extra is small beside a large model's backward); ``*_per_tensor_s``, that
    divided by ``tensors`` (parameter tensors, one hook each); ``plain_backward_s``; and
    ``ours_host_per_tensor_s``, host time inside our hook bodies and end-of-backward
    callback per parameter tensor (clocked around each call in ``steps`` more steps; on
    a GPU the host may run ahead of the device, and then this is not in ``ours_s``)."""
    device = current_device()
    work = _Workload(model, width, depth, batch, seq, gpt)
    x, y = work.data(device)
    plain = _Plain(work.net(device))
    ours = DDP(work.net(device), bucket_cap_mb=bucket_mb, all_reduce=_no_collective)
    theirs = _torch_ddp(work.net(device), device, bucket_mb)
    theirs.register_comm_hook(None, _torch_no_collective)
    models = [plain, ours, theirs]
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    _time_backwards(models, opts, x, y, work.loss, warmup, device)
    base, extra = [], {"ours": [], "torch": []}
    for _ in range(rounds):
        dist.barrier()
        plain_s, ours_s, torch_s = _time_backwards(models, opts, x, y, work.loss, steps, device)
        base += plain_s
        extra["ours"] += [o - p for o, p in zip(ours_s, plain_s)]
        extra["torch"] += [t - p for t, p in zip(torch_s, plain_s)]
    # host time in our hooks: the same DDP, its hooks and end-of-backward callback clocked
    total = [0]
    ours.remove_hooks()
    for p in ours.params:
        ours._register(p, _timed(ours._hook, total))
    ours._finish = _timed(DDP._finish.__get__(ours), total)

    def host_s():
        ns, total[0] = total[0], 0
        return ns * 1e-9

    dist.barrier()
    host = _time_backwards([ours], [opts[1]], x, y, work.loss, steps, device, host_s)[-1]
    tensors = len(ours.params)
    result = {"tensors": tensors, "plain_backward_s": statistics.median(base)}
    for who in ("ours", "torch"):
        result[f"{who}_s"] = statistics.median(extra[who])
        result[f"{who}_per_tensor_s"] = result[f"{who}_s"] / tensors
    result["ours_host_per_tensor_s"] = statistics.median(host) / tensors
    return result


def format_hook_cost(cost):
    us, n = 1e6, cost["tensors"]
    return (f"our hooks: {cost['ours_per_tensor_s'] * us:.1f} us per parameter tensor "
            f"({n} tensors), {cost['ours_s'] * 1e3:.2f} ms per step\n"
            f"  (extra backward time with no collective, over a plain backward of "
            f"{cost['plain_backward_s'] * 1e3:.1f} ms; host time in our hook bodies: "
            f"{cost['ours_host_per_tensor_s'] * us:.1f} us per tensor)\n"
            f"torch DDP's reducer, the same way: {cost['torch_per_tensor_s'] * us:.1f} us per "
            f"parameter tensor, {cost['torch_s'] * 1e3:.2f} ms per step")
