"""ZeRO-2: the gradients are sharded too, not only the optimizer state (Lab 03, Exercise 3.11).

In the ZeRO paper's notation a model has ψ parameters and data parallelism n
ranks. ZeRO-1 behind DDP all-reduces the whole gradient (2ψ(n-1)/n elements sent
per rank), steps its shard and all-gathers the shards (ψ(n-1)/n more): 3ψ(n-1)/n.
But rank r only ever reads shard r of the averaged gradient, so ZeRO-2 asks for
exactly that, with a reduce-scatter instead of the all-reduce::

    after backward (no DDP: the gradients are still this rank's own):
      reduce-scatter the flat gradient, divided by n: rank r gets shard r, averaged
      free the full gradients (each rank now holds ψ/n of them)
      rank r: optimizer step on shard r (its state: Kψ/n)
      all-gather the updated shards into every rank's full parameters

A reduce-scatter and an all-gather each send ψ(n-1)/n: 2ψ(n-1)/n per step, the
bytes of DDP's all-reduce, which is a reduce-scatter followed by an all-gather.
Model state per rank, fp32 with AdamW: 4ψ of parameters + 4ψ/n of gradient +
8ψ/n of optimizer state.

This version reduces after backward, in one flat collective, so that the three
steps read in order. The full local gradients therefore still exist at the end
of backward; a production ZeRO-2 (DeepSpeed's, FSDP's SHARD_GRAD_OP) reduces each
bucket as soon as backward has filled it and frees it, which is what lowers the
peak as well::

    zero2 = ZeRO2(model.parameters(), lambda shard: torch.optim.AdamW(shard, lr=1e-3))
    zero2.zero_grad(); loss.backward(); zero2.step()
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.collectives.select import collective_ops
from course_lib.fsdp.zero1 import ShardedOptimizer


class ZeRO2(ShardedOptimizer):
    """``make_optimizer([shard])`` steps this rank's shard of the flat ``params``
    (one dtype) on their reduce-scattered, averaged gradient; the updated shards
    are all-gathered over ``group`` (ZeRO-1's :class:`ShardedOptimizer` does the
    flattening, padding and gathering). The model is not wrapped in DDP. A parameter
    without a gradient counts as a zero gradient (the flat buffer cannot skip it)."""

    def __init__(self, params, make_optimizer, group=None):
        super().__init__(params, make_optimizer, group)  # make_optimizer([shard])
        self.world = dist.get_world_size(group)

    @torch.no_grad()
    def reduce_gradients(self):
        """Shard r of the gradient averaged over the ranks into ``shard.grad``; the
        parameters' full gradients are dropped, so none outlives this call."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flatten(grads)
        for p in self.params:
            p.grad = None
        mine = flat.new_empty(self.shard_numel)
        collective_ops().reduce_scatter(mine, flat, group=self.group)
        # the collective sums; the loss is each rank's mean, so divide once, here
        self.shard.grad = mine.div_(self.world)

    @torch.no_grad()
    def step(self):
        self.reduce_gradients()
        self.optimizer.step()
        self._gather_params()

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        self.shard.grad = None
