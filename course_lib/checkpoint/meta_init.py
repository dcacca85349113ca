"""Init without the whole model (Lab 08): build on the meta device, shard, then give
each rank only its own slices, exactly as the dense model would have them.

A model too big for one device cannot be built whole and then sharded. Built under
``torch.device("meta")`` it has every parameter's shape and dtype and no memory at
all; FSDP (flat shards) or tensor parallelism (row and column slices) can then cut
it as usual, still holding nothing. What is left is to fill each rank's pieces with
the values ``GPT(cfg, seed=0)`` would give them, bitwise, without ever holding the
whole model.

The catch is the random numbers. An init draws each parameter from a generator in a
fixed order, and the value of an element depends on every draw before it: to get
its slice of a weight, a rank must make the draws of that whole weight. With one
generator for the whole model (torch's default init) that means every parameter
before it too, i.e. the whole model. The course's init
(:func:`~course_lib.models.param_by_name`) gives each parameter a generator of its
own, seeded by its name, so a rank can go **one parameter at a time**: draw that
parameter whole, copy out the part it owns, drop the rest, go on to the next. The
cost is honest and small: the peak is **one shard plus the largest parameter** (the
shard fills up as it goes; one whole parameter is alive at a time). Getting rid of
that second term takes a counter-based generator (JAX's Threefry, cuRAND's Philox),
where element i's value is a function of (seed, i) and a rank can draw its slice
directly; torch's CPU ``randn`` is not one, so we pay one parameter.

    model, peak = meta_fsdp(cfg, group)       # FSDP(GPT on meta, units=by_type(Block))
    model, peak = meta_tp(cfg, group)         # parallelize_block on each block
    materialize(model, seed=0)                # any such meta model, in place

Each rank maps its pieces to the dense names as the sharded checkpoints do
(:mod:`~course_lib.checkpoint.state`): an FSDP shard is a flat range of its unit's
concatenated parameters, so it takes the matching flat range of each parameter it
overlaps (the padding stays zero); a ``ColumnParallelLinear`` cuts the dense
weight with its own ``shard_weight`` (rows, one block per part for the fused q/k/v),
a ``RowParallelLinear`` its columns; everything else is replicated whole.

The peak is measured by :class:`LiveBytes`: the bytes of the tensors created under
it (every op's output that owns new storage, on any device but meta) that are still
alive, and the most at once. It sees what Python-level torch allocates, not a
kernel's internal scratch nor storage grown in place by ``resize_`` (how FSDP brings
back its gathered buffer: not part of an init); ``tracemalloc`` sees none of torch's memory, and on a
GPU ``torch.cuda.max_memory_allocated`` would show the allocator's view of the
device part only.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from course_lib.fsdp import FSDP, by_type
from course_lib.models import GPT, Block, param_by_name
from course_lib.runtime.backend import current_device
from course_lib.tp.blocks import parallelize_block
from course_lib.tp.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["LiveBytes", "meta_gpt", "materialize", "meta_fsdp", "meta_tp"]


class LiveBytes(TorchDispatchMode):
    """``now``: bytes of the storages that ops under it created and that are still
    alive; ``peak``: the most at once. A storage counts from the op that made it to
    the moment its last tensor (or view, or parameter) goes::

        with LiveBytes() as live:
            a = torch.randn(1000)      # now 4000
            b = a[:10]                 # a view: no new bytes
            del a                      # b keeps the storage alive
        live.peak                      # 4000
    """

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self._alive = set()  # ids of the storages counted and not yet freed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._count(t.untyped_storage(), args, kwargs)
        return out

    def _count(self, storage, args, kwargs):
        key = id(storage)  # a storage keeps its Python object while it lives
        inputs = tree_flatten((args, kwargs))[0]
        if key in self._alive or any(isinstance(t, torch.Tensor) and t.device.type != "meta"
                                     and id(t.untyped_storage()) == key for t in inputs):
            return  # counted already, or an input's (a view, an in-place op)
        nbytes = storage.nbytes()
        self._alive.add(key)
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key, nbytes):
        self._alive.discard(key)
        self.now -= nbytes


def meta_gpt(cfg) -> GPT:
    """The course GPT on the meta device: every shape, no bytes, no values."""
    with torch.device("meta"):
        return GPT(cfg)  # init_deterministic skips meta parameters


def _fill_flat(flat, seed, device):
    """This rank's shard of one FSDP flat parameter, one dense parameter at a time."""
    rank = dist.get_rank(flat.shard_group) if flat.shard_group is not None else 0
    lo, hi = rank * flat.shard_numel, (rank + 1) * flat.shard_numel
    shard = torch.zeros(flat.shard_numel, dtype=flat.dtype, device=device)  # padding: 0
    at = 0
    for name, shape, numel in zip(flat.names, flat.shapes, flat.numels):
        start, end = max(lo, at), min(hi, at + numel)
        if start < end:  # the flat range [start, end) falls in this parameter
            full = param_by_name(name, shape, seed)  # the whole parameter, for a moment
            shard[start - lo:end - lo].copy_(full.view(-1)[start - at:end - at])
            del full
        at += numel
    flat.materialize(shard)


def _local_value(module, attr, name, shape, seed):
    """This rank's value of parameter ``attr`` of ``module`` (dense name ``name``)."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        dense = (module.out_features, module.in_features) if attr == "weight" \
            else (module.out_features,)
        full = param_by_name(name, dense, seed)
        return module.shard_weight(full) if attr == "weight" else module.shard_bias(full)
    return param_by_name(name, shape, seed)  # replicated: the whole parameter is the piece


@torch.no_grad()
def materialize(model, seed=0, device=None):
    """Give a model built on the meta device (plain, tensor parallel, or wrapped in
    :class:`~course_lib.fsdp.FSDP`) this rank's values of ``GPT``'s init under
    ``seed``, on ``device`` (this rank's device by default), one parameter at a time.
    Parameter names must be the dense model's (the course's TP and FSDP keep them).
    Returns ``model``."""
    device = current_device() if device is None else torch.device(device)
    inner = model.module if isinstance(model, FSDP) else model
    meta_buffers = [name for name, b in inner.named_buffers() if b.device.type == "meta"]
    if meta_buffers:
        raise ValueError(f"buffers {meta_buffers} are on the meta device: this init gives "
                         "values to parameters only")
    if isinstance(model, FSDP):
        if any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in inner.modules()):
            raise NotImplementedError("FSDP over tensor-parallel layers: a flat range of a "
                                      "TP slice is not a flat range of the dense parameter")
        flats = [flat for unit in model.units for flat in unit.flats]
        if any(flat.device.type != "meta" for flat in flats):
            raise ValueError("materialize takes an FSDP model built on the meta device")
        for flat in flats:
            _fill_flat(flat, seed, device)
        model.shards = nn.ParameterList(flat.shard for flat in flats)
        return model
    for module_name, module in model.named_modules():
        for attr, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            value = _local_value(module, attr, name, p.shape, seed).to(device, p.dtype)
            if value.shape != p.shape:
                raise ValueError(f"{name}: the init gives {tuple(value.shape)}, the model "
                                 f"holds {tuple(p.shape)}")
            new = nn.Parameter(value, requires_grad=p.requires_grad)
            new.__dict__.update(p.__dict__)  # flags such as sequence_parallel
            module._parameters[attr] = new
    return model


def meta_fsdp(cfg, group=None, seed=0, device=None, units=None, **fsdp_options):
    """(FSDP model, peak bytes): the GPT built on meta, wrapped (units: each
    ``Block`` by default) over ``group``, then this rank's shards filled."""
    with LiveBytes() as live:
        model = FSDP(meta_gpt(cfg), units=units or by_type(Block), group=group,
                     **fsdp_options)
        materialize(model, seed, device)
    return model, live.peak


def meta_tp(cfg, group=None, seed=0, device=None):
    """(model, peak bytes): the GPT built on meta, each block tensor parallel over
    ``group`` (:func:`~course_lib.tp.parallelize_block`), then this rank's slices
    and the replicated parameters filled."""
    with LiveBytes() as live:
        model = meta_gpt(cfg)
        for block in model.blocks:
            parallelize_block(block, group)
        materialize(model, seed, device)
    return model, live.peak
