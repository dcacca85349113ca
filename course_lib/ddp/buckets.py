"""Gradient buckets for :class:`course_lib.ddp.DDP`: the plan (pure data) and
the buffers.

:func:`assign_buckets` is the plan: walk the parameters in *reverse* order
(backward produces the last layer's gradients first) and close a bucket as soon
as it holds at least the cap; parameters of different dtype or device never
share a bucket (one flat buffer each). Like torch, the first bucket is capped
lower (1 MiB) so that the first all-reduce can start early in backward::

    assign_buckets([40, 40, 40, 40], cap_bytes=80)   # [[3, 2], [1, 0]]
"""
from __future__ import annotations

import torch

from course_lib.handle import Handle


def assign_buckets(sizes_bytes, cap_bytes, keys=None, first_cap_bytes=None, order=None):
    """Bucket plan: a list of buckets, each a list of parameter indices, in the
    order the buckets will be all-reduced.

    ``order`` is the order in which the gradients are expected to become ready:
    by default the reverse of registration; after one backward, torch's reducer
    rebuilds its buckets from the order it observed. Each dtype/device key has
    its own open bucket, capped at ``first_cap_bytes`` until its first bucket
    closes and at ``cap_bytes`` after (torch's ``compute_bucket_assignment_by_size``)."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    keys = keys if keys is not None else [None] * len(sizes_bytes)
    order = reversed(range(len(sizes_bytes))) if order is None else order
    first_cap = cap_bytes if first_cap_bytes is None else min(first_cap_bytes, cap_bytes)
    plan, open_buckets, closed_any = [], {}, set()
    for index in order:
        key = keys[index]
        bucket = open_buckets.setdefault(key, [[], 0])
        bucket[0].append(index)
        bucket[1] += sizes_bytes[index]
        limit = cap_bytes if key in closed_any else first_cap
        if bucket[1] >= limit:
            plan.append(bucket[0])
            closed_any.add(key)
            del open_buckets[key]
    # what is left closes in the order the buckets were opened
    plan += [indices for indices, _ in open_buckets.values()]
    return plan


def grad_or_zeros(p):
    """A parameter this rank did not use still takes part, with a zero gradient,
    so that every rank launches the same collectives (and nobody hangs)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


class Bucket:
    """One flat buffer for the gradients of ``params`` (same dtype and device)."""

    def __init__(self, index, params):
        self.index, self.params = index, params
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self._views, self._views_of = None, None
        self.reset()

    def reset(self):
        self.ready = [False] * len(self.params)
        self.pending, self.work = len(self.params), None

    @property
    def complete(self):
        return self.pending == 0

    def _slices(self):
        """Each parameter's slice of the buffer, made once (slicing costs a tensor per call,
        and the hooks ask at every gradient); made again if ``buffer`` is replaced."""
        if self._views_of is not self.buffer:
            self._views = [self.buffer[start:start + p.numel()]
                           for start, p in zip(self.offsets, self.params)]
            self._views_of = self.buffer
        return self._views

    def _view(self, slot):
        return self._slices()[slot]

    def mark_ready(self, slot, grad, world):
        """Put one gradient in, pre-divided by K, so that a SUM all-reduce leaves
        the average. After the first step each .grad *is* a view of the buffer
        (torch's gradient_as_bucket_view), so autograd accumulates straight into
        the bucket and this is a division in place, not a copy (none at all when
        K is 1: one kernel less per gradient on one GPU)."""
        if self.ready[slot]:
            raise RuntimeError(
                f"the gradient of a parameter in bucket {self.index} became ready twice in one "
                "backward pass. DDP synchronises once per backward: call backward once per "
                "step, or use no_sync() for the extra passes.")
        view = self._slices()[slot]
        if grad.data_ptr() == view.data_ptr():
            if world != 1:
                view.div_(world)
        else:
            torch.div(grad.reshape(-1), world, out=view)
        self.ready[slot] = True
        self.pending -= 1

    def fill_missing(self, world):
        """Parameters whose hook did not fire this pass contribute what their
        .grad holds (zeros if None)."""
        for slot, p in enumerate(self.params):
            if not self.ready[slot]:
                self.mark_ready(slot, grad_or_zeros(p), world)

    def write_back(self, keep=()):
        """Make every .grad the averaged slice of the buffer (a view: no copy).
        Parameters whose id is in ``keep`` (no rank used them) keep their ``.grad`` as it
        was, None included, as torch does with ``find_unused_parameters``."""
        for p, view in zip(self.params, self._slices()):
            if id(p) in keep:
                continue
            grad = p.grad
            if grad is None or grad.data_ptr() != view.data_ptr():
                p.grad = view.view_as(p)


def make_all_reduce(kind, group=None):
    """``launch(tensor) -> Handle``: an asynchronous SUM all-reduce over ``group``.

    "torch": ``dist.all_reduce(async_op=True)``. "ring": course_lib's ring, run
    on the group's helper thread so that it overlaps backward (one thread keeps
    the buckets in order). A callable: ``fn(tensor)`` returning a work or
    handle, or None when it reduced in place synchronously."""
    if kind in ("torch", "ring"):
        from course_lib.collectives.select import collective_ops

        all_reduce = collective_ops(kind).all_reduce
        return lambda tensor: Handle.from_works(all_reduce(tensor, group=group, async_op=True))
    if callable(kind):
        def launch(tensor):
            work = kind(tensor)
            return Handle.completed() if work is None else Handle.from_works(work)
        return launch
    raise ValueError(f"all_reduce must be 'torch', 'ring' or a callable, got {kind!r}")
