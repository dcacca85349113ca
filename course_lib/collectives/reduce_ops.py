"""Pieces every collective shares: validation, reduction ops, chunking, buffers."""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp
_OPS = {ReduceOp.SUM: "SUM", ReduceOp.AVG: "AVG", ReduceOp.MAX: "MAX", ReduceOp.MIN: "MIN",
        ReduceOp.PRODUCT: "PRODUCT"}


def validate(tensor, op=None, root=None, name="tensor"):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if op is not None:
        if op not in _OPS:
            raise ValueError(f"unsupported op {op!r}; use one of {list(_OPS.values())}")
        if op == ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
            raise ValueError(f"AVG of {tensor.dtype} is not defined (as in torch): "
                             "use SUM and divide")
    if root is not None and not 0 <= root < dist.get_world_size():
        raise ValueError(f"root rank {root} is not in [0, {dist.get_world_size()})")


def combine(acc, incoming, op, out=None):
    """out <- acc (op) incoming (``out`` defaults to ``acc``: in place). AVG sums
    here and divides at the end."""
    out = acc if out is None else out
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        torch.add(acc, incoming, out=out)
    elif op == ReduceOp.PRODUCT:
        torch.mul(acc, incoming, out=out)
    elif op == ReduceOp.MAX:
        torch.maximum(acc, incoming, out=out)
    else:
        torch.minimum(acc, incoming, out=out)
    return out


_scratch_cache = threading.local()


def scratch(numel, like, slot):
    """A reusable receive buffer of ``numel`` elements (dtype and device of ``like``).
    Fresh allocations of tens of MB per call cost page faults comparable to the
    transfer itself, so buffers are kept per thread and grown when needed."""
    cache = _scratch_cache.__dict__.setdefault("buffers", {})
    key = (like.dtype, like.device, slot)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def chunk_bounds(numel, parts):
    """[(start, stop)] of ``parts`` near-equal chunks: the first numel % parts get
    one element more, so no chunk exceeds ceil(numel / parts)."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class Flat:
    """A contiguous 1-D view of ``tensor`` (a copy if it is not contiguous), and
    the way back."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)

    def done(self):
        if self.flat.data_ptr() != self.tensor.data_ptr() or not self.tensor.is_contiguous():
            self.tensor.copy_(self.flat.view_as(self.tensor))
        return self.tensor


def ring_neighbours():
    rank, world = dist.get_rank(), dist.get_world_size()
    return rank, world, (rank + 1) % world, (rank - 1) % world
