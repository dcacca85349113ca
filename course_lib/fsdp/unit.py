"""An FSDP unit in one page: the teaching version of :class:`~course_lib.fsdp.FSDP` (Lab 03).

Three pieces make a unit; Lab 03's exercises 3.5-3.7 have the student write each:

1. :func:`flatten_and_shard` (3.5): the unit's parameters, flattened into one
   buffer of psi elements, padded to a multiple of n, and rank r's 1/n of it.
2. :class:`GatherShards` (3.6): an autograd Function. Forward all-gathers the n
   shards into the full flat parameter; backward reduce-scatters the full
   gradient back, averaged over the n ranks, so each rank's shard receives
   its slice of the data-parallel mean gradient. Autograd does the rest: the
   layers use views of the full buffer, their gradients flow into it.
3. :func:`free_between_passes` (3.7): full sharding. Saved-tensor hooks pack a
   saved tensor that is a view of the full buffer as (offset, size, stride)
   instead of keeping it, so the buffer can be freed right after forward; the
   first unpack in backward gathers it again. That is FULL_SHARD; without the
   hooks autograd keeps the views alive until backward (SHARD_GRAD_OP).

:class:`ShardedUnit` wires them around one module; :func:`shard_model` makes a
unit of each submodule of some types, and one of the rest (the root)::

    model = shard_model(GPT(cfg), (Block,))       # every rank, inside a job
    opt = torch.optim.AdamW(model.parameters())   # the shards only
    model(x) ... .backward(); opt.step()

Per step a unit moves 3 psi (n-1)/n bytes with full sharding (all-gather,
all-gather again, reduce-scatter) and 2 psi (n-1)/n without. The library's
:class:`~course_lib.fsdp.FSDP` does the same with hooks on flat parameters,
prefetches, and frees the gradient buffer early; this one trades that for
brevity.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.collectives.select import collective_ops


def _world(group):
    return dist.get_world_size(group)


def flatten_and_shard(tensors, rank, world):
    """(shard, padded): the tensors flattened and concatenated (psi elements),
    zero-padded to ``padded`` = the next multiple of ``world`` (at least one
    element per rank), and rank ``rank``'s slice [rank*s, (rank+1)*s), s = padded/world."""
    numel = sum(t.numel() for t in tensors)
    padded = max(math.ceil(numel / world) * world, world)
    flat = torch.zeros(padded, dtype=tensors[0].dtype, device=tensors[0].device)
    if numel:
        torch.cat([t.detach().reshape(-1) for t in tensors], out=flat[:numel])
    size = padded // world
    return flat[rank * size:(rank + 1) * size].clone(), padded


class GatherShards(torch.autograd.Function):
    """full = all_gather(shard) forward; grad_shard = reduce_scatter(grad_full) / n
    backward. ``GatherShards.apply(shard, group)``: (s,) -> (n s,)."""

    @staticmethod
    def forward(ctx, shard, group):
        ctx.group = group
        full = shard.new_empty(shard.numel() * _world(group))
        collective_ops().all_gather(full, shard.contiguous(), group=group)
        return full

    @staticmethod
    def backward(ctx, grad_full):
        n = _world(ctx.group)
        grad_shard = grad_full.new_empty(grad_full.numel() // n)
        collective_ops().reduce_scatter(grad_shard, grad_full.contiguous(), group=ctx.group)
        return grad_shard.div_(n), None


def free_between_passes(full, regather):
    """(pack, unpack) saved-tensor hooks for a unit whose full flat buffer is
    ``full``: a saved view of it is packed as ("full", offset, size, stride) so
    the buffer can be freed; unpack calls ``regather()`` (idempotent: the first
    call gathers) and rebuilds the view. Anything else passes through."""
    storage = full.untyped_storage().data_ptr()

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() == storage:
            return ("full", tensor.storage_offset(), tensor.size(), tensor.stride())
        return tensor

    def unpack(saved):
        if isinstance(saved, tuple) and saved and saved[0] == "full":
            _, offset, size, stride = saved
            regather()
            return full.detach().as_strided(size, stride, offset)
        return saved

    return pack, unpack


class ShardedUnit(nn.Module):
    """``module``'s own parameters (those not in a nested ShardedUnit) as one
    flat, padded, sharded parameter ``shard``, gathered for each forward.

    ``flatten``, ``gather`` and ``hooks`` default to this module's reference
    pieces; Lab 03's checks pass the student's. ``reshard_after_forward``:
    free the full parameters between forward and backward (FULL_SHARD)."""

    def __init__(self, module, group=None, *, reshard_after_forward=True,
                 flatten=flatten_and_shard, gather=None, hooks=free_between_passes):
        super().__init__()
        self.module, self.group = module, group
        self.reshard_after_forward = reshard_after_forward
        self.gather = gather or GatherShards.apply
        self.hooks = hooks
        own = [(name, p) for name, p in module.named_parameters()
               if not _inside_unit(module, name)]
        if not own:
            raise ValueError(f"{type(module).__name__} has no parameters of its own to shard")
        self.names = [name for name, _ in own]
        self.shapes = [p.shape for _, p in own]
        shard, self.padded = flatten([p for _, p in own], dist.get_rank(group), _world(group))
        self.shard = nn.Parameter(shard)
        for name in self.names:  # the shard is the only copy kept
            owner, attr = _owner(module, name)
            del owner._parameters[attr]
        self.full = None  # the gathered buffer, while it exists
        self.gathers = 0  # all-gathers this unit has issued (forward and backward)

    def _point_modules_at(self, full):
        offset = 0
        for name, shape in zip(self.names, self.shapes):
            numel = math.prod(shape)
            owner, attr = _owner(self.module, name)
            setattr(owner, attr, full[offset:offset + numel].view(shape))
            offset += numel

    @property
    def unsharded(self):
        """Whether the full parameters are in memory now."""
        return self.full is not None and self.full.untyped_storage().nbytes() > 0

    def _regather(self, full):
        """Gather into ``full`` again if it was freed (the first unpack in backward)."""
        if full.untyped_storage().nbytes() > 0:
            return
        full.untyped_storage().resize_(self.padded * full.element_size())
        collective_ops().all_gather(full.detach(), self.shard.detach(), group=self.group)
        self.gathers += 1

    @staticmethod
    def _free(full):
        full.untyped_storage().resize_(0)

    def forward(self, *args, **kwargs):
        full = self.gather(self.shard, self.group)
        if full.shape != (self.padded,):
            raise ValueError(f"the gathered flat parameter has shape {tuple(full.shape)}, "
                             f"expected ({self.padded},): n shards of {self.shard.numel()}")
        self.full = full
        self.gathers += 1
        self._point_modules_at(full)
        if not torch.is_grad_enabled():  # no backward will come: free at once
            out = self.module(*args, **kwargs)
            self._free(full)
            return out
        if full.requires_grad:  # its gradient is complete once every use in backward is done
            full.register_hook(lambda grad: self._free(full))
        if not self.reshard_after_forward:
            return self.module(*args, **kwargs)
        # a closure over this forward's buffer: a second forward before backward gets its own
        with torch.autograd.graph.saved_tensors_hooks(*self.hooks(full,
                                                                  lambda: self._regather(full))):
            out = self.module(*args, **kwargs)
        self._free(full)
        return out

    def full_tensors(self):
        """{name: full tensor} of this unit's own parameters, gathered now."""
        full = self.shard.new_empty(self.padded)
        collective_ops().all_gather(full, self.shard.detach(), group=self.group)
        out, offset = {}, 0
        for name, shape in zip(self.names, self.shapes):
            numel = math.prod(shape)
            out[name] = full[offset:offset + numel].view(shape).clone()
            offset += numel
        return out


def _owner(module, name):
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def _inside_unit(module, name):
    parts = name.split(".")[:-1]
    for i in range(1, len(parts) + 1):
        if isinstance(module.get_submodule(".".join(parts[:i])), ShardedUnit):
            return True
    return False


def shard_model(model, unit_types, group=None, **unit_kwargs):
    """Each submodule of one of ``unit_types`` becomes a ShardedUnit, then the
    model itself (the root: whatever no unit claimed). Returns the root unit."""
    for name, child in list(model.named_modules()):
        if name and isinstance(child, tuple(unit_types)) and not _inside_unit(model, name + ".x"):
            owner, attr = _owner(model, name)
            setattr(owner, attr, ShardedUnit(child, group, **unit_kwargs))
    return ShardedUnit(model, group, **unit_kwargs)


def full_state_dict(root):
    """The unsharded parameters of a :func:`shard_model` model under the original
    names (the units' wrapper names removed), on every rank."""
    state = {}
    for prefix, unit in root.named_modules():
        if isinstance(unit, ShardedUnit):
            base = original_name(prefix)
            for name, tensor in unit.full_tensors().items():
                state[original_name(f"{base}.{name}" if base else name)] = tensor
    return state


def original_name(name):
    """A parameter's name in the model before :func:`shard_model` wrapped it:
    "module.blocks.0.module.ln1.weight" -> "blocks.0.ln1.weight"."""
    return ".".join(part for part in name.split(".") if part != "module")
