"""Data parallelism the simple way: a full replica per rank, gradients averaged after backward.

Every rank holds a full replica, computes gradients on its own shard of the
batch, and before the optimizer step every gradient is replaced by its average
over the K ranks. Then all replicas take the same step and stay identical.

- :class:`NaiveDDP` all-reduces each gradient on its own after backward: one
  collective per parameter, each paying the latency alpha.
- :class:`FlatDDP` copies all gradients into one flat buffer and all-reduces it
  once after backward: one alpha, but no overlap with backward.

The bucketed version that overlaps with backward is :class:`course_lib.ddp.DDP`.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import trace
from course_lib.ddp.buckets import grad_or_zeros, make_all_reduce


def _queue_end_of_backward(callback):
    """Run ``callback`` once the current backward pass has finished."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class _DataParallel(nn.Module):
    """Shared parts: replicate from the group's rank 0, find trainable parameters,
    no_sync. ``process_group`` (torch's name) is the group of replicas: the
    world by default, a mesh's dp group when other dims shard the model."""

    def __init__(self, module, all_reduce="torch", process_group=None, broadcast_buffers=True):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.world = dist.get_world_size(process_group)
        self.launch = make_all_reduce(all_reduce, process_group)
        self.params = _trainable(module)
        # As torch: whether a backward synchronises is decided by the forward that
        # built its graph, so no_sync() must wrap the forward (nanoGPT sets the
        # attribute directly on the last micro-step instead).
        self.require_backward_grad_sync = True
        # torch's name too: whether the next forward broadcasts the buffers. True at
        # first; afterwards, whether the last forward was a synchronising training
        # forward (grad enabled and require_backward_grad_sync).
        self.require_forward_param_sync = True
        # torch's reducer "expects autograd hooks" from a synchronising forward until
        # the end of the backward that synchronised: a no_grad or no_sync forward in
        # between does not disarm it.
        self._sync_backward = False
        with torch.no_grad():  # every replica starts from the group's rank 0 weights
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, group=process_group, group_src=0)
        # Re-wrapping a module (a notebook cell run twice) must not leave the old
        # wrapper's hooks on its parameters: each gradient would be reduced twice.
        for handle in getattr(module, "_data_parallel_hooks", []):
            handle.remove()
        module._data_parallel_hooks = self._hook_handles = []

    def _register(self, param, hook):
        self._hook_handles.append(param.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self):
        """Take this wrapper's hooks off the module's parameters."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def _before_forward(self):
        """Subclasses drop what an interrupted backward left behind here."""

    def forward(self, *args, **kwargs):
        self._before_forward()
        if self.require_forward_param_sync and self.broadcast_buffers and self.world > 1:
            self._broadcast_buffers()
        output = self.module(*args, **kwargs)
        # torch decides both after the module's forward (its _post_forward)
        synchronising = torch.is_grad_enabled() and self.require_backward_grad_sync
        if synchronising:
            self._sync_backward = True
        self.require_forward_param_sync = synchronising
        return output

    def _broadcast_buffers(self):
        """Rank 0's buffers (BatchNorm's running statistics) overwrite everyone's, as
        torch's DDP does with broadcast_buffers=True. torch does it only at a forward
        that follows a synchronising training forward (and at the first): after a
        no_sync() or no_grad forward the buffers stay as each rank left them."""
        with torch.no_grad():
            for buffer in self.module.buffers():
                dist.broadcast(buffer, group=self.process_group, group_src=0)

    @contextmanager
    def no_sync(self):
        """Forwards inside the block build graphs whose backward accumulates
        gradients locally; the first backward of a forward outside it
        synchronises the accumulated sum."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous


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

    def __init__(self, module, all_reduce="torch", process_group=None, broadcast_buffers=True):
        super().__init__(module, all_reduce, process_group, broadcast_buffers)
        self._queued = False
        for p in self.params:
            self._register(p, self._hook)

    def _before_forward(self):
        if self._queued:  # a backward that raised never reached its end-of-backward callback
            self._queued = self._sync_backward = False

    def sync_gradients(self):
        """Average the gradients accumulated so far, now. For a loop whose backward
        passes come in an order no forward can announce (a pipeline stage's
        microbatches, Lab 06): leave ``require_backward_grad_sync`` False and call
        this once after the last backward of the step."""
        self._sync()

    def _hook(self, param):
        if self._sync_backward and not self._queued:
            self._queued = True
            _queue_end_of_backward(self._sync)

    def _sync(self):
        self._queued = self._sync_backward = False
        for p in self.params:
            p.grad = grad_or_zeros(p)
            with trace.span("all_reduce grad", "comm", bytes=p.grad.nbytes):
                self.launch(p.grad).wait()
            p.grad.div_(self.world)


class FlatDDP(NaiveDDP):
    """After backward, all gradients in one flat buffer per dtype (and device),
    one all-reduce each."""

    def _sync(self):
        self._queued = self._sync_backward = False
        groups = {}
        for p in self.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        for params in groups.values():
            grads = [grad_or_zeros(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            with trace.span("all_reduce flat", "comm", bytes=flat.nbytes):
                self.launch(flat).wait()
            flat.div_(self.world)
            offset = 0
            for p, g in zip(params, grads):
                p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
                offset += g.numel()
