"""Distributed data parallel, three ways: naive, flat, and bucketed with overlap.

Every rank holds a full replica, computes gradients on its own shard of the
batch, and before the optimizer step every gradient is replaced by its average
over the K ranks. Then all replicas take the same step and stay identical.

- :class:`NaiveDDP` all-reduces each gradient on its own after backward: one
  collective per parameter, each paying the latency alpha.
- :class:`FlatDDP` copies all gradients into one flat buffer and all-reduces it
  once after backward: one alpha, but no overlap with backward.
- :class:`DDP` what torch's DistributedDataParallel does: parameters are put
  in buckets of about ``bucket_cap_mb`` in *reverse* order (gradients become
  ready roughly from the last layer to the first), a hook on each parameter
  marks it ready, and a bucket whose gradients are all ready is all-reduced
  asynchronously at once, in bucket order, while backward carries on.

All three are used the same way; when ``loss.backward()`` returns, every
``.grad`` holds the average over ranks::

    model = DDP(net, bucket_cap_mb=25)
    loss_fn(model(x), y).backward()
    opt.step()
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from . import trace
from .ddp_buckets import Bucket, assign_buckets, grad_or_zeros, make_all_reduce


def _now_ns():
    return trace.get_tracer().clock() if trace.get_tracer() else 0


def _queue_end_of_backward(callback):
    """Run ``callback`` once the current backward pass has finished."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class _DataParallel(nn.Module):
    """Shared parts: replicate from rank 0, find trainable parameters, no_sync."""

    def __init__(self, module, all_reduce="torch"):
        super().__init__()
        self.module = module
        self.world = dist.get_world_size()
        self.launch = make_all_reduce(all_reduce)
        self.params = _trainable(module)
        self.require_sync = True
        with torch.no_grad():  # every replica starts from rank 0's weights
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally inside the block; the first backward
        outside it synchronises the accumulated sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous


def _trainable(module):
    """Parameters with requires_grad, each once (tied weights are one parameter)."""
    seen, params = set(), []
    for p in module.parameters():  # already de-duplicates shared parameters
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


class NaiveDDP(_DataParallel):
    """After backward, one all-reduce per gradient, then divide by K."""

    def __init__(self, module, all_reduce="torch"):
        super().__init__(module, all_reduce)
        self._queued = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, param):
        if self.require_sync and not self._queued:
            self._queued = True
            _queue_end_of_backward(self._sync)

    def _sync(self):
        self._queued = False
        for p in self.params:
            p.grad = grad_or_zeros(p)
            with trace.span("all_reduce grad", "comm", bytes=p.grad.nbytes):
                self.launch(p.grad).wait()
            p.grad.div_(self.world)


class FlatDDP(NaiveDDP):
    """After backward, all gradients in one flat buffer, one all-reduce."""

    def _sync(self):
        self._queued = False
        grads = [grad_or_zeros(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        with trace.span("all_reduce flat", "comm", bytes=flat.nbytes):
            self.launch(flat).wait()
        flat.div_(self.world)
        offset = 0
        for p, g in zip(self.params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
            offset += g.numel()


class DDP(_DataParallel):
    """Bucketed gradients, all-reduced asynchronously during backward.

    ``first_bucket_mb`` (default: 1 MiB, as torch) caps the first bucket, the
    one holding the last layers, so that communication can start early."""

    def __init__(self, module, bucket_cap_mb=25.0, all_reduce="torch", first_bucket_mb=1.0):
        super().__init__(module, all_reduce)
        sizes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]
        plan = assign_buckets(sizes, int(bucket_cap_mb * 2**20), keys=keys,
                              first_cap_bytes=int(first_bucket_mb * 2**20))
        self.buckets = [Bucket(i, [self.params[j] for j in idx]) for i, idx in enumerate(plan)]
        self._locate = {id(p): (b, k) for b in self.buckets for k, p in enumerate(b.params)}
        self.launched = []  # bucket indices in the order they were launched (last step)
        self._reset()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._hook)

    @property
    def bucket_plan(self):
        """Parameter indices (into ``self.params``) of each bucket, in bucket order."""
        index = {id(p): i for i, p in enumerate(self.params)}
        return [[index[id(p)] for p in b.params] for b in self.buckets]

    def _reset(self):
        self._next, self._queued, self._first_hook_ns = 0, False, None
        for b in self.buckets:
            b.reset()

    def _hook(self, param):
        # The hook receives the parameter (its .grad is already accumulated).
        if not self.require_sync:
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
