"""Bucketed DDP: what torch's DistributedDataParallel does, from scratch.

Gradients go into flat buckets of about ``bucket_cap_mb``, a hook on each
parameter marks it ready, and a bucket whose gradients are all ready is
all-reduced asynchronously at once, in bucket order, while backward carries on.
When ``loss.backward()`` returns, every ``.grad`` holds the average over ranks::

    model = DDP(net)                      # 25 MiB buckets, the first one 1 MiB
    loss_fn(model(x), y).backward()
    opt.step()

As torch 2.13's reducer: the first iteration puts everything in one bucket per
dtype (the order in which gradients become ready is not known yet); the next
forward rebuilds the buckets in the order rank 0 observed, so a model whose
layers are registered in another order than they are used still overlaps.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from course_lib import trace
from course_lib.ddp.buckets import Bucket, assign_buckets
from course_lib.ddp.comm_hooks import GradBucket, hook_result
from course_lib.ddp.naive import _DataParallel, _queue_end_of_backward
from course_lib.handle import Handle

DEFAULT_BUCKET_CAP_MB = 25.0
FIRST_BUCKET_MB = 1.0  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES


class DDP(_DataParallel):
    """Bucketed gradients, all-reduced asynchronously during backward.

    ``bucket_cap_mb`` means what it means in torch: left out, buckets of 25 MiB
    and a first bucket (the gradients ready first) of 1 MiB, so communication
    starts early; given, the first bucket has that cap too. ``first_bucket_mb``
    overrides the first cap. With ``find_unused_parameters=True`` a parameter no
    rank used keeps its ``.grad`` (None stays None, so AdamW does not decay it),
    at the price of one more small all-reduce per step; buckets are then never
    rebuilt, as in torch (the graph may change from step to step).

    ``overlap=False`` (not in torch) holds every bucket until backward has
    finished: Lab 02's experiment separating overlap from fewer messages."""

    def __init__(self, module, bucket_cap_mb=None, all_reduce="torch", process_group=None,
                 broadcast_buffers=True, find_unused_parameters=False, first_bucket_mb=None,
                 overlap=True):
        super().__init__(module, all_reduce, process_group, broadcast_buffers)
        self.overlap = overlap
        cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        if first_bucket_mb is None:
            first_bucket_mb = FIRST_BUCKET_MB if bucket_cap_mb is None else cap_mb
        self.cap_bytes, self.first_cap_bytes = int(cap_mb * 2**20), int(first_bucket_mb * 2**20)
        if self.cap_bytes <= 0 or self.first_cap_bytes <= 0:
            raise ValueError(f"bucket caps must be at least one byte, got bucket_cap_mb="
                             f"{bucket_cap_mb} and first_bucket_mb={first_bucket_mb}")
        self.find_unused_parameters = find_unused_parameters
        self._sizes = [p.numel() * p.element_size() for p in self.params]
        self._keys = [(p.dtype, p.device) for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._comm_hook = None
        self.ready_order = []  # parameter indices, in the order their hooks fired (first sync)
        if find_unused_parameters:
            # torch walks the registration order with the [first, cap] limits and
            # reverses the buckets: the small one holds the first layers
            plan = assign_buckets(self._sizes, self.cap_bytes, self._keys, self.first_cap_bytes,
                                  order=range(len(self.params)))
            plan = sorted(plan, key=min)[::-1]
            self.rebuilt = True
        else:
            plan = assign_buckets(self._sizes, sys.maxsize, self._keys)
            self.rebuilt = False
        self._use_plan(plan)
        self.launched = []  # bucket indices in the order they were launched (last step)
        self._reset()
        for p in self.params:
            self._register(p, self._hook)

    def _use_plan(self, plan):
        self.buckets = [Bucket(i, [self.params[j] for j in idx]) for i, idx in enumerate(plan)]
        # id(parameter) -> (its index in self.params, its bucket, its slot there): one
        # lookup per hook call
        self._locate = {id(self.params[j]): (j, b, k)
                        for b, idx in zip(self.buckets, plan) for k, j in enumerate(idx)}

    @property
    def bucket_plan(self):
        """Parameter indices (into ``self.params``) of each bucket, in bucket order."""
        return [[self._index[id(p)] for p in b.params] for b in self.buckets]

    def register_comm_hook(self, state, hook):
        """Replace the all-reduce of each bucket by ``hook(state, bucket)``, which
        returns a future of the reduced buffer (see :mod:`course_lib.ddp.comm_hooks`).
        As in torch: once, before the first backward; the hook divides by K itself."""
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once")
        if self._queued or self.ready_order:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        self._comm_hook = (state, hook)

    def _reset(self):
        self._next, self._queued = 0, False
        self._used = [False] * len(self.params)
        for b in self.buckets:
            b.reset()

    @property
    def _divisor(self):
        return 1 if self._comm_hook is not None else self.world

    def _before_forward(self):
        super()._before_forward()
        if self._queued:  # the last backward raised before its end: drop what it left
            for bucket in self.buckets[:self._next]:
                bucket.work.wait()  # launched on every rank that got this far
            self._reset()
            self._sync_backward = False
            if not self.rebuilt:
                self.ready_order = []
        if not self.rebuilt and self.ready_order and torch.is_grad_enabled():
            self._rebuild_buckets()

    def _rebuild_buckets(self):
        """Torch's ``_rebuild_buckets``: bucket in the order gradients became
        ready during the first synchronised backward, as rank 0 saw it (all
        ranks must agree on the buckets, or their all-reduces mismatch)."""
        seen = set(self.ready_order)
        order = self.ready_order + [i for i in reversed(range(len(self.params))) if i not in seen]
        order = torch.tensor(order, dtype=torch.int64, device=self.params[0].device)
        dist.broadcast(order, group=self.process_group, group_src=0)
        self._use_plan(assign_buckets(self._sizes, self.cap_bytes, self._keys,
                                      self.first_cap_bytes, order=order.tolist()))
        self._reset()
        self.rebuilt = True

    def _hook(self, param):
        # The hook receives the parameter (its .grad is already accumulated).
        if not self._sync_backward:
            return
        if not self._queued:
            self._queued = True
            self.launched = []
            _queue_end_of_backward(self._finish)
        index, bucket, slot = self._locate[id(param)]
        self._used[index] = True
        if not self.rebuilt:
            self.ready_order.append(index)
        bucket.mark_ready(slot, param.grad, self._divisor)
        # only a bucket that has just become complete can let buckets be launched
        if self.overlap and not bucket.pending:
            self._launch_ready()

    def _launch(self, bucket):
        if self._comm_hook is None:
            return self.launch(bucket.buffer)
        state, hook = self._comm_hook
        grad_bucket = GradBucket(bucket, is_last=bucket.index == len(self.buckets) - 1)
        return Handle.from_future(hook(state, grad_bucket))

    def _launch_ready(self):
        """Launch buckets strictly in bucket order, as soon as each is complete,
        so that every rank issues the same collectives in the same order."""
        buckets, tracing = self.buckets, trace.get_tracer() is not None
        while self._next < len(buckets) and buckets[self._next].complete:
            bucket = buckets[self._next]
            work = self._launch(bucket)
            if tracing:
                work = trace.async_span(f"bucket {bucket.index}", "comm", work,
                                        bytes=bucket.buffer.nbytes)
            bucket.work = work
            self.launched.append(bucket.index)
            self._next += 1

    def _globally_unused(self):
        """Ids of the parameters no rank used this pass (one small all-reduce, issued as
        the buckets are: after them, in the same order on every rank; with the ring,
        on the rank's helper thread, not from this autograd callback beside it)."""
        used = torch.tensor(self._used, dtype=torch.int32, device=self.params[0].device)
        self.launch(used).wait()
        return {id(p) for p, count in zip(self.params, used.tolist()) if count == 0}

    def _finish(self):
        """End of backward: finish the buckets, copy the averages back."""
        for bucket in self.buckets[self._next:]:
            bucket.fill_missing(self._divisor)  # unused parameters: same collectives
        self._launch_ready()
        keep = self._globally_unused() if self.find_unused_parameters else ()
        for bucket in self.buckets:
            bucket.work.wait()
            if self._comm_hook is not None:
                reduced = hook_result(bucket.work.get_future())
                if reduced.data_ptr() != bucket.buffer.data_ptr():
                    bucket.buffer.copy_(reduced.reshape(-1))
            bucket.write_back(keep)
        self._reset()
        self._sync_backward = False  # as torch's reducer: armed again by the next forward
