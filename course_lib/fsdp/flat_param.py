"""A flat parameter: one FSDP unit's parameters in one 1-D buffer, sharded (Lab 03).

The parameters of a unit (one dtype, one requires_grad) are concatenated into
a flat buffer of psi elements, padded to a multiple of the shard group's size
n, and cut into n equal shards; rank r keeps shard r as an ``nn.Parameter``,
the only copy the optimizer ever sees::

    flat [ w1 ........ | b1 .. | w2 ....... | pad ]     psi + pad = n * shard
           rank 0's shard | rank 1's shard | ...

``unshard()`` all-gathers the full buffer (``full``, a leaf tensor that
requires grad) and points each module attribute at a view of it, so forward
and backward use ordinary tensors; gradients of the views accumulate into
``full.grad``. ``reshard()`` frees the full buffer's storage (size 0) without
dropping the tensor: autograd may still hold views of it, and the next
``unshard()`` refills the same storage before backward reads them.
``reduce_grad()`` reduce-scatters ``full.grad`` (pre-divided by the number of
replicas) into ``shard.grad``; with a replicate group (HYBRID_SHARD, or NO_SHARD
where the shard group is one rank) the shard's gradient is then all-reduced
across it.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import trace
from course_lib.handle import Handle


def _size(group):
    return 1 if group is None else dist.get_world_size(group)


class FlatParam:
    """``entries``: (owners, full name, parameter) of one unit, all of one dtype
    and requires_grad; owners are the (module, attribute) pairs that hold the
    parameter (several for tied weights). ``collectives`` has ``all_gather``,
    ``reduce_scatter`` and ``all_reduce`` taking ``group=`` and ``async_op=``."""

    def __init__(self, entries, shard_group, replicate_group, collectives, label="flat"):
        self.label = label  # how the timeline names this buffer's collectives
        first = entries[0][2]
        self.dtype, self.device, self.requires_grad = first.dtype, first.device, first.requires_grad
        self.owners = [owners for owners, _, _ in entries]
        self.names = [name for _, name, _ in entries]
        self.shapes = [p.shape for *_, p in entries]
        self.numels = [p.numel() for *_, p in entries]
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.collectives = collectives
        n = _size(shard_group)
        self.numel = sum(self.numels)  # psi: the unit's own elements
        self.padded = math.ceil(self.numel / n) * n if self.numel else n
        self.shard_numel = self.padded // n
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        torch.cat([p.detach().reshape(-1) for *_, p in entries], out=flat[:self.numel])
        rank = dist.get_rank(shard_group) if shard_group is not None else 0
        start = rank * self.shard_numel
        self.shard = nn.Parameter(flat[start:start + self.shard_numel].clone(),
                                  requires_grad=self.requires_grad)
        self.full = None  # the gathered buffer, allocated at the first unshard
        self.on_grad = None  # a post-accumulate-grad hook for ``full`` (FSDP's post-backward)
        self.pending = None  # the Handle of an all-gather in flight
        for owners in self.owners:
            for module, attr in owners:
                del module._parameters[attr]  # the shard is the parameter now

    # ---- parameters ---------------------------------------------------------------------
    @property
    def unsharded(self):
        return self.full is not None and self.full.untyped_storage().nbytes() > 0

    def unshard(self, async_op=False):
        """Start (or do) the all-gather of the full buffer; idempotent."""
        if self.unsharded or self.pending is not None:
            return self.pending
        if self.full is None:
            self.full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
            self.full.requires_grad_(self.requires_grad)
            if self.on_grad is not None:
                self.full.register_post_accumulate_grad_hook(self.on_grad)
        else:  # storage freed by reshard(): give it its bytes back
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        # .data: the write must not bump the version autograd checks saved views against
        if self.device.type == "meta":  # no values to gather: shapes only
            self.pending = Handle.completed()
        elif _size(self.shard_group) == 1:
            self.full.data.copy_(self.shard.data)
            self.pending = Handle.completed()
        else:
            work = self.collectives.all_gather(self.full.data, self.shard.data,
                                               group=self.shard_group, async_op=True)
            self.pending = trace.async_span(f"all_gather {self.label}", "comm", _handle(work),
                                            bytes=self.full.nbytes)
        if not async_op:
            self.wait()
        return self.pending

    def wait(self):
        """Finish a pending all-gather and point the modules at views of ``full``."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        offset = 0
        for owners, shape, numel in zip(self.owners, self.shapes, self.numels):
            view = self.full[offset:offset + numel].view(shape)
            for module, attr in owners:
                setattr(module, attr, view)
            offset += numel

    def reshard(self):
        """Free the full buffer's memory; views of it stay valid objects."""
        if self.pending is not None:
            self.wait()
        if self.full is not None:
            self.full.untyped_storage().resize_(0)

    def materialize(self, shard):
        """Replace a meta flat parameter's shard by ``shard`` (this rank's values, on
        their device); ``full`` is allocated again, there, at the next unshard."""
        self.shard = nn.Parameter(shard, requires_grad=self.requires_grad)
        self.device, self.full, self.pending = shard.device, None, None

    # ---- gradients -----------------------------------------------------------------------
    def reduce_grad(self, replicas):
        """``shard.grad`` (+)= this rank's shard of the average of ``full.grad`` over
        ``replicas`` ranks; frees ``full.grad``."""
        grad = self.full.grad if self.full is not None else None
        if grad is None:  # no view was used: every rank still joins the collectives
            grad = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        grad = grad.div_(replicas)
        out = torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)
        if _size(self.shard_group) == 1:
            out.copy_(grad)
        else:
            with trace.span(f"reduce_scatter {self.label}", "comm", bytes=grad.nbytes):
                _handle(self.collectives.reduce_scatter(out, grad, group=self.shard_group,
                                                        async_op=True)).wait()
        if self.replicate_group is not None and _size(self.replicate_group) > 1:
            with trace.span(f"all_reduce {self.label}", "comm", bytes=out.nbytes):
                _handle(self.collectives.all_reduce(out, group=self.replicate_group,
                                                    async_op=True)).wait()
        if self.shard.grad is None:
            self.shard.grad = out
        else:
            self.shard.grad += out
        if self.full is not None:
            self.full.grad = None

    def full_tensors(self):
        """{name: full tensor} gathered now (for a state dict), on every rank."""
        full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        if _size(self.shard_group) == 1:
            full.copy_(self.shard.detach())
        else:
            _handle(self.collectives.all_gather(full, self.shard.detach(), group=self.shard_group,
                                                async_op=True)).wait()
        out, offset = {}, 0
        for name, shape, numel in zip(self.names, self.shapes, self.numels):
            out[name] = full[offset:offset + numel].view(shape).clone()
            offset += numel
        return out


def _handle(work):
    return work if isinstance(work, Handle) else Handle.from_works(work)
