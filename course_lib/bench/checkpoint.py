"""Sharded checkpoints, ours against torch.distributed.checkpoint (DCP) on the same state,
in one job (Lab 08).

The state: ``tensors`` fp32 matrices of ``size_mb`` MB in all, each split by rows over the
ranks (every rank ``rows / n`` of them): ours as ShardedTensors, DCP's as DTensors
``Shard(0)`` on a one-dimensional mesh, so both write the same bytes. Each round saves
and loads with both (a new directory each time, alternating which goes first), then an
asynchronous save of ours: the time the loop is blocked (host copy and one gather) against
the synchronous save's. Before timing, both loads are checked against the saved values.
Times are the slowest rank's, medians over rounds.
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.checkpoint import AsyncCheckpointer, ShardedTensor, load, save

VARIANTS = ("ours", "dcp")


def _state(size_mb, tensors, seed):
    n, r = dist.get_world_size(), dist.get_rank()
    cols = 256
    rows = max(n, int(size_mb * 2 ** 20 / 4 / cols / tensors) // n * n)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    state = {}
    for i in range(tensors):
        whole = torch.randn(rows, cols, generator=gen, device="cpu")
        state[f"layer{i}.weight"] = whole.chunk(n)[r].clone()
    return state, (rows, cols)


def _ours(local, shape):
    r = dist.get_rank()
    return {k: ShardedTensor(v, shape, (r * v.shape[0], 0)) for k, v in local.items()}


def _dcp(local, shape):
    from torch.distributed.tensor import DTensor, Shard

    from course_lib.runtime.backend import device_mesh

    mesh = device_mesh()
    return {k: DTensor.from_local(v, mesh, [Shard(0)], shape=shape, stride=(shape[1], 1))
            for k, v in local.items()}


def _slowest(seconds):
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


def measure(size_mb=64, tensors=8, rounds=3, seed=0, root=None):
    """{"save_s", "load_s": {variant: s}, "async_blocked_s", "sync_save_s", "bytes",
    "max_diff"} (run it on every rank; ``root``: a folder every rank sees)."""
    import torch.distributed.checkpoint as dcp

    local, shape = _state(size_mb, tensors, seed)
    own = tempfile.mkdtemp(prefix="course-ckpt-") if root is None else None
    shared = [own]
    dist.broadcast_object_list(shared)  # rank 0's folder: one node, one file system
    base = Path(root or shared[0])
    try:
        def ours_save(path):
            save(_ours(local, shape), path)

        def ours_load(path):
            target = _ours({k: torch.empty_like(v) for k, v in local.items()}, shape)
            load(target, path)
            return {k: v.local for k, v in target.items()}

        def dcp_save(path):
            dcp.save(_dcp(local, shape), checkpoint_id=str(path))

        def dcp_load(path):
            target = _dcp({k: torch.empty_like(v) for k, v in local.items()}, shape)
            dcp.load(target, checkpoint_id=str(path))
            return {k: v.to_local() for k, v in target.items()}

        fns = {"ours": (ours_save, ours_load), "dcp": (dcp_save, dcp_load)}
        worst = 0.0
        for name, (saver, loader) in fns.items():  # correctness first, untimed
            saver(base / f"check_{name}")
            got = loader(base / f"check_{name}")
            worst = max(worst, max((got[k] - local[k]).abs().max().item() for k in local))
        times = {name: {"save": [], "load": []} for name in VARIANTS}
        blocked, sync = [], []
        for i in range(rounds):
            for name in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):
                saver, loader = fns[name]
                path = base / f"{name}_{i}"
                times[name]["save"].append(_timed(lambda: saver(path)))
                times[name]["load"].append(_timed(lambda: loader(path)))
            checkpointer = AsyncCheckpointer()
            checkpointer.save(_ours(local, shape), base / f"async_{i}")
            blocked.append(_slowest(checkpointer.blocked_s))
            checkpointer.wait()
            dist.barrier()
            sync.append(times["ours"]["save"][-1])
        worst_t = torch.tensor([worst], dtype=torch.float64)
        dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
        return {"save_s": {k: statistics.median(v["save"]) for k, v in times.items()},
                "load_s": {k: statistics.median(v["load"]) for k, v in times.items()},
                "async_blocked_s": statistics.median(blocked),
                "sync_save_s": statistics.median(sync),
                "bytes": sum(v.numel() * 4 for v in local.values()) * dist.get_world_size(),
                "max_diff": worst_t.item(), "nproc": dist.get_world_size()}
    finally:
        dist.barrier()
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


def format_table(result):
    s, ld = result["save_s"], result["load_s"]
    lines = [f"sharded checkpoint of {result['bytes'] / 2 ** 20:.0f} MiB on {result['nproc']} "
             f"ranks (rows split), max |loaded - saved| {result['max_diff']:.1e}:",
             f"{'':>6} {'save ms':>9} {'load ms':>9}"]
    for name in VARIANTS:
        lines.append(f"{name:>6} {s[name] * 1e3:>9.1f} {ld[name] * 1e3:>9.1f}")
    lines.append(f"ratios ours / DCP: save {s['ours'] / s['dcp']:.2f}, load "
                 f"{ld['ours'] / ld['dcp']:.2f}")
    lines.append(f"async save: the loop blocked {result['async_blocked_s'] * 1e3:.1f} ms, "
                 f"{result['async_blocked_s'] / result['sync_save_s']:.0%} of a synchronous "
                 f"save's {result['sync_save_s'] * 1e3:.1f} ms")
    return "\n".join(lines)
