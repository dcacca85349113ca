"""Measured memory, to set beside the formulas (Lab 03).

- :func:`model_state_bytes_of`: bytes of parameters, gradients and optimizer
  state, each storage counted once (tied weights, views of a flat buffer).
- :func:`peak_bytes`: the highest allocation level inside a block, above the
  level at its start. On a GPU, ``torch.cuda.max_memory_allocated``. On the
  CPU, the allocator's events as ``torch.profiler`` records them with
  ``profile_memory=True``: every allocation is charged to the operator that
  made it (its *self* memory) and every free is a ``[memory]`` event; their
  running sum in time order is the level, its maximum the peak::

    with peak_bytes() as peak:
        model(x).sum().backward()
    peak.peak   # bytes
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def _storages(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor (torch FSDP2): this rank's shard
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_state_bytes_of(model, optimizer=None):
    """{"params", "grads", "optimizer", "total"} bytes on this rank. Optimizer
    state counts its tensors of more than one element (AdamW's per-parameter
    ``step`` counters are scalars: a few bytes, left out as the formulas do)."""
    params = list(model.parameters())
    state = []
    if optimizer is not None:
        for entry in optimizer.state.values():
            state += [t for t in entry.values() if torch.is_tensor(t) and t.numel() > 1]
    out = {"params": _storages(params), "grads": _storages(p.grad for p in params),
           "optimizer": _storages(state)}
    out["total"] = sum(out.values())
    return out


class Peak:
    peak = 0  # bytes above the level at entry, at the highest
    end = 0  # bytes above that level on exit


@contextmanager
def peak_bytes(device=None):
    """Measure the peak allocation inside the block (see the module docstring)."""
    result = Peak()
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result.peak = torch.cuda.max_memory_allocated(device) - start
        result.end = torch.cuda.memory_allocated(device) - start
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage),
                    key=lambda e: e.time_range.start)
    level = 0
    for event in events:
        level += event.self_cpu_memory_usage
        result.peak = max(result.peak, level)
    result.end = level
