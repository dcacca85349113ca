"""ZeRO-1: every rank keeps the optimizer state of its shard of the parameters only (Lab 03).

Adam keeps two more numbers per parameter (and mixed precision a master copy):
12 bytes of the 16 per parameter of DDP training. Elementwise optimizers
(SGD, Adam, AdamW) update each element from that element's gradient and state
alone, so rank r can update shard r of the flat parameters by itself:

    after backward (gradients averaged, e.g. by DDP):
      rank r: optimizer step on shard r of the flat parameters (its state: 12P/n bytes)
      all-gather the updated shards into every rank's full parameters

Optimizer-state bytes per rank drop from 12P to 12P/n; the parameters and
gradients stay whole (ZeRO-2 and 3, i.e. FSDP, shard those too)::

    model = DDP(net)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.collectives.select import collective_ops


class ShardedOptimizer:
    """``optimizer_cls(**kwargs)`` run on this rank's shard of ``params`` (one
    dtype), the updated shards all-gathered over ``group`` after each step.
    A parameter without a gradient counts as a zero gradient (as one flat
    buffer, the shard cannot skip part of itself)."""

    def __init__(self, params, optimizer_cls, group=None, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError(f"{type(self).__name__} got no parameters that require grad")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"{type(self).__name__} shards one flat buffer: one dtype, got {dtypes}")
        self.group = group
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.padded = math.ceil(self.numel / n) * n
        self.shard_numel = self.padded // n
        self._start = rank * self.shard_numel
        flat = self._flatten([p.detach() for p in self.params])
        self.shard = nn.Parameter(flat[self._start:self._start + self.shard_numel].clone())
        self.optimizer = optimizer_cls([self.shard], **kwargs)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def _flatten(self, tensors):
        first = self.params[0]
        flat = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[:self.numel])
        return flat

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.shard.grad = self._flatten(grads)[self._start:self._start + self.shard_numel]
        self.optimizer.step()
        self._gather_params()

    @torch.no_grad()
    def _gather_params(self):
        """Every rank's updated shard into every rank's full parameters."""
        full = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        # counted (comm.counting), as DDP's and FSDP's collectives are
        collective_ops().all_gather(full, self.shard.detach(), group=self.group)
        offset = 0
        for p in self.params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
