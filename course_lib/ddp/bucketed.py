"""Bucketed DDP: what torch's DistributedDataParallel does, from scratch.

Parameters are put in buckets of about ``bucket_cap_mb`` in *reverse* order
(gradients become ready roughly from the last layer to the first), a hook on
each parameter marks it ready, and a bucket whose gradients are all ready is
all-reduced asynchronously at once, in bucket order, while backward carries on.
When ``loss.backward()`` returns, every ``.grad`` holds the average over ranks::

    model = DDP(net, bucket_cap_mb=25)
    loss_fn(model(x), y).backward()
    opt.step()
"""
from __future__ import annotations

from course_lib import trace
from course_lib.ddp.buckets import Bucket, assign_buckets
from course_lib.ddp.naive import _DataParallel, _now_ns, _queue_end_of_backward


class DDP(_DataParallel):
    """Bucketed gradients, all-reduced asynchronously during backward.

    ``first_bucket_mb`` (default: 1 MiB, as torch) caps the first bucket, the
    one holding the last layers, so that communication can start early."""

    def __init__(self, module, bucket_cap_mb=25.0, all_reduce="torch", first_bucket_mb=1.0,
                 process_group=None, broadcast_buffers=True):
        super().__init__(module, all_reduce, process_group, broadcast_buffers)
        sizes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]
        plan = assign_buckets(sizes, int(bucket_cap_mb * 2**20), keys=keys,
                              first_cap_bytes=int(first_bucket_mb * 2**20))
        self.buckets = [Bucket(i, [self.params[j] for j in idx]) for i, idx in enumerate(plan)]
        self._locate = {id(p): (b, k) for b in self.buckets for k, p in enumerate(b.params)}
        self.launched = []  # bucket indices in the order they were launched (last step)
        self._reset()
        for p in self.params:
            self._register(p, self._hook)

    @property
    def bucket_plan(self):
        """Parameter indices (into ``self.params``) of each bucket, in bucket order."""
        index = {id(p): i for i, p in enumerate(self.params)}
        return [[index[id(p)] for p in b.params] for b in self.buckets]

    def _reset(self):
        self._next, self._queued, self._first_hook_ns = 0, False, None
        self._sync_backward = False  # the next sync needs a forward of its own
        for b in self.buckets:
            b.reset()

    def _hook(self, param):
        # The hook receives the parameter (its .grad is already accumulated).
        if not self._sync_backward:
            return
        if not self._queued:
            self._queued = True
            self.launched = []
            self._first_hook_ns = _now_ns()
            _queue_end_of_backward(self._finish)
        bucket, slot = self._locate[id(param)]
        bucket.mark_ready(slot, param.grad, self.world)
        self._launch_ready()

    def _launch_ready(self):
        """Launch buckets strictly in bucket order, as soon as each is complete,
        so that every rank issues the same collectives in the same order."""
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            bucket = self.buckets[self._next]
            bucket.work = trace.async_span(f"bucket {bucket.index}", "comm",
                                           self.launch(bucket.buffer),
                                           bytes=bucket.buffer.nbytes)
            self.launched.append(bucket.index)
            self._next += 1

    def _finish(self):
        """End of backward: finish the buckets, copy the averages back."""
        tracer = trace.get_tracer()
        if tracer is not None:  # gradient computation: first hook to end of backward
            tracer.record("backward", "compute", self._first_hook_ns, _now_ns())
        for bucket in self.buckets[self._next:]:
            bucket.fill_missing(self.world)  # unused parameters: zeros, same collectives
        self._launch_ready()
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.write_back()
        self._reset()
