"""The sharded state of a model trained by any of the course's strategies, under the
dense model's parameter names, so that any layout can load what any other saved
(Lab 08).

- a plain module or DDP: every parameter replicated (a plain tensor: rank 0 writes it);
- our FSDP (:class:`~course_lib.fsdp.FSDP`): each unit's flat shard is a flat range of
  the unit's concatenated parameters; its part inside each parameter is a flat range of
  that parameter, i.e. a few boxes (:func:`~course_lib.checkpoint.boxes.boxes_of_flat_range`);
- tensor parallelism: a ``ColumnParallelLinear``'s rows (one box per part: the fused
  q/k/v projection holds rank r's rows of each of q, k and v), a ``RowParallelLinear``'s
  columns (its bias replicated).

With an optimizer, its per-parameter tensors of the parameter's shape (Adam's two
moments) are sharded as the parameter is, under ``optim.<name>.<key>``, and its scalar
tensors (Adam's step) are replicated::

    save(state_of(fsdp_model, adam), "ckpt/step_000100")          # on 4 ranks
    load(state_of(tp_model, adam_tp), "ckpt/step_000100")         # on 2 ranks
"""
from __future__ import annotations

import torch

from course_lib.checkpoint.boxes import ShardedTensor, boxes_of_flat_range
from course_lib.checkpoint.load import load
from course_lib.fsdp import FSDP
from course_lib.tp.layers import ColumnParallelLinear, RowParallelLinear


def _flat_boxes(flat, tensor):
    """{name: [ShardedTensor]}: the views of ``tensor`` (a flat shard, or a tensor of
    its shape: a moment) that fall inside each parameter of ``flat``."""
    from torch import distributed as dist

    rank = dist.get_rank(flat.shard_group) if flat.shard_group is not None else 0
    lo, hi = rank * flat.shard_numel, (rank + 1) * flat.shard_numel
    out, at = {}, 0
    for name, shape, numel in zip(flat.names, flat.shapes, flat.numels):
        start, end = max(lo, at), min(hi, at + numel)
        pieces = []
        if start < end:
            offset = start - lo  # where this parameter's part starts in the shard
            for offsets, sizes in boxes_of_flat_range(shape, start - at, end - start):
                count = int(torch.tensor(sizes).prod())
                pieces.append(ShardedTensor(tensor.data[offset:offset + count].view(sizes),
                                            tuple(shape), offsets))
                offset += count
        else:  # this rank holds none of it: an empty box keeps the name in its place
            pieces.append(ShardedTensor(tensor.data.new_empty((0,) * len(shape)), tuple(shape),
                                        (0,) * len(shape)))
        out[name] = pieces
        at += numel
    return out


def _column_boxes(layer, tensor):
    """Rank r's rows of each of the layer's ``parts`` as boxes of the whole."""
    out = tensor.shape[0] * layer.t  # the whole layer's rows
    per = out // (layer.parts * layer.t)
    whole = (out, *tensor.shape[1:])
    return [ShardedTensor(tensor.data[i * per:(i + 1) * per], whole,
                          (i * layer.t * per + layer.rank * per, *[0] * (tensor.dim() - 1)))
            for i in range(layer.parts)]


def _tp_entry(module, attr, tensor):
    if isinstance(module, ColumnParallelLinear):
        return _column_boxes(module, tensor)
    if isinstance(module, RowParallelLinear) and attr == "weight":
        whole = (tensor.shape[0], tensor.shape[1] * module.t)
        return ShardedTensor(tensor.data, whole, (0, module.rank * tensor.shape[1]))
    return tensor.data  # replicated


def _entries(model):
    """[(name, parameter, sharded(tensor) -> state entry)] of the model's parameters."""
    if isinstance(model, FSDP):
        return [(None, flat.shard, lambda t, flat=flat: _flat_boxes(flat, t))
                for unit in model.units for flat in unit.flats]
    inner = getattr(model, "module", model)  # DDP and friends
    entries = []
    for module_name, module in inner.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}" if module_name else attr
            entries.append((name, p, lambda t, m=module, a=attr: _tp_entry(m, a, t)))
    return entries


def state_of(model, optimizer=None):
    """``{name: entry}`` for :func:`~course_lib.checkpoint.save` and ``load`` (see the
    module); entries are views of the model's (and optimizer's) tensors, so a load
    fills them in place."""
    state = {}
    for name, param, entry_of in _entries(model):
        entry = entry_of(param)
        if name is None:  # an FSDP shard: several parameters at once
            state.update(entry)
        else:
            state[name] = entry
        if optimizer is None:
            continue
        moments = optimizer.state.get(param, {})
        for key, value in moments.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape == param.shape:
                sharded = entry_of(value)
                if name is None:
                    state.update({f"optim.{n}.{key}": e for n, e in sharded.items()})
                else:
                    state[f"optim.{name}.{key}"] = sharded
            elif value.dim() == 0 and key == "step":
                state["optim.step"] = value  # one count for every parameter, replicated
    return state


def ensure_optimizer_state(model, optimizer):
    """Give every parameter its optimizer state before a load fills it (Adam creates it
    at the first step): a step at learning rate 0 on zero gradients, so nothing moves."""
    if optimizer is None or optimizer.state:
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    grads = {}
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            grads[p] = p.grad
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
    for p, grad in grads.items():
        p.grad = grad


def set_optimizer_step(state, optimizer):
    """After a load: every parameter's step count is the one saved (``optim.step``)."""
    if "optim.step" not in state:
        return
    for per_param in optimizer.state.values():
        if isinstance(per_param.get("step"), torch.Tensor):
            per_param["step"].copy_(state["optim.step"])


def restore(path, model, optimizer=None):
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``), whatever
    layout saved it; returns the bytes this rank read."""
    ensure_optimizer_state(model, optimizer)
    state = state_of(model, optimizer)
    read = load(state, path)
    set_optimizer_step(state, optimizer)
    return read


__all__ = ["state_of", "restore", "ensure_optimizer_state", "set_optimizer_step"]
