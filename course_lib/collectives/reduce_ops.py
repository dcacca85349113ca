"""Pieces every collective shares: validation, reduction ops, chunking, buffers."""
from __future__ import annotations

import functools
import inspect
import threading

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp
_OPS = {ReduceOp.SUM: "SUM", ReduceOp.AVG: "AVG", ReduceOp.MAX: "MAX", ReduceOp.MIN: "MIN",
        ReduceOp.PRODUCT: "PRODUCT"}


def validate(tensor, op=None, root=None, name="tensor", group=None):
    """Raise ValueError, before any message is sent, for what torch would refuse.
    ``root`` is a group-local rank of ``group``."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if op is not None:
        if op not in _OPS:
            raise ValueError(f"unsupported op {op!r}; use one of {list(_OPS.values())}")
        if op == ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
            raise ValueError(f"AVG of {tensor.dtype} is not defined (as in torch): "
                             "use SUM and divide")
    if root is not None and not 0 <= root < dist.get_world_size(group):
        raise ValueError(f"root rank {root} is not in [0, {dist.get_world_size(group)}) "
                         "(ranks are local to the process group)")
    if dist.get_rank(group) < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of this process group")


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


_scratch_lock = threading.Lock()
_scratch_cache: dict = {}  # (thread, group key, dtype, device, slot) -> buffer


def group_key(group):
    """A key naming a process group (None is the world)."""
    return ("group", id(group if group is not None else dist.group.WORLD))


def scratch(numel, like, slot, group=None):
    """A reusable receive buffer of ``numel`` elements (dtype and device of ``like``).
    Fresh allocations of tens of MB per call cost page faults comparable to the
    transfer itself, so buffers are kept and grown when needed. They belong to one
    operation at a time: kept per thread (an asynchronous operation runs on a
    helper thread) and per process group, so two operations in flight never share
    one; :func:`forget_groups` lets those of destroyed groups go."""
    key = (threading.get_ident(), group_key(group), like.dtype, like.device, slot)
    with _scratch_lock:
        buf = _scratch_cache.get(key)
        if buf is None or buf.numel() < numel:
            buf = _scratch_cache[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def forget_groups(live):
    """Drop the scratch buffers of every group not in ``live`` (a warm rank, after a
    call destroyed the groups it made: their buffers would outlive them)."""
    keep = {group_key(g) for g in live} | {group_key(None)}
    with _scratch_lock:
        for key in [k for k in _scratch_cache if k[1] not in keep]:
            del _scratch_cache[key]


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


def ring_neighbours(group=None):
    """(rank, world size, right, left), all local to ``group``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return rank, world, (rank + 1) % world, (rank - 1) % world


def asynchronous(fn):
    """Give a collective ``async_op=False``: with True it runs on the rank's helper
    thread (operations start in issue order, as on every rank) and a
    :class:`~course_lib.handle.Handle` comes back at once; without, it runs in
    that order too (:func:`~course_lib.handle.run_in_order`)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, async_op=False, **kwargs):
        from course_lib.handle import Handle, run_in_order

        if not async_op:
            return run_in_order(fn, *args, **kwargs)
        group = signature.bind(*args, **kwargs).arguments.get("group")
        return Handle.on_thread(group_key(group), fn, *args, **kwargs)

    return wrapper
