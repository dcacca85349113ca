"""A second opinion on a sharded load: the same state through torch.distributed.checkpoint
(DCP), for checking ours against it (Lab 08, Exercise 8.4).

Three steps, each on every rank of a group:

- :func:`dense_state`: the model's (and optimizer's) whole tensors under the names of
  :func:`~course_lib.checkpoint.state.state_of`, gathered from our FSDP's shards (its own
  gather for the parameters, the same all-gather over its shard group for Adam's moments);
- :func:`save_dense`: those tensors to DCP, each split by rows over the group (a DTensor
  ``Shard(0)`` on a one-dimensional mesh), so that DCP stores one row block per rank;
- :func:`dcp_boxes`: fill a state of any layout (the ShardedTensors of ``state_of``) from
  that checkpoint. DCP reshards the row blocks into whole tensors, which are then cut by
  the state's boxes: the fused q/k/v rows of tensor parallelism have no DTensor placement,
  and a whole tensor per name keeps the reference simple (the course's models are small).

Where our :func:`~course_lib.checkpoint.load.load` and DCP agree box by box, neither got
the geometry wrong, or both did the same way::

    save(state_of(fsdp_model, adam), "ours")                            # 4 ranks
    save_dense(dense_state(fsdp_model, adam), "dcp")
    ours, theirs = state_of(tp_model, adam_tp), empty_like_state(state_of(tp_model, adam_tp))
    load(ours, "ours"); dcp_boxes("dcp", theirs)                        # 2 ranks
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.checkpoint.boxes import ShardedTensor, is_sharded, map_state
from course_lib.checkpoint.state import state_of
from course_lib.fsdp import FSDP


def _gathered(flat, shard):
    """The unit's whole flat buffer of ``shard`` (its parameter shard or a tensor of that
    shape), cut into {name: whole tensor}: FlatParam.full_tensors for any shard."""
    if flat.shard_group is None:  # NO_SHARD: this rank holds the whole buffer
        full = shard.detach().clone()
    else:
        full = shard.new_empty(flat.padded)
        # the unit's own all-gather (torch's, or Lab 01's ring), as FSDP gathers parameters
        flat.collectives.all_gather(full, shard.detach().contiguous(), group=flat.shard_group)
    out, at = {}, 0
    for name, shape, numel in zip(flat.names, flat.shapes, flat.numels):
        out[name] = full[at:at + numel].view(shape).clone()
        at += numel
    return out


def dense_state(model, optimizer=None):
    """{name: whole tensor} of ``model`` (and ``optimizer``'s per-parameter tensors and
    step), the same on every rank, under ``state_of``'s names. ``model``: our FSDP (every
    rank of each unit's shard group calls this: it all-gathers), or a model whose
    ``state_of`` entries are already whole (a plain module, DDP)."""
    if not isinstance(model, FSDP):
        dense = {}
        for name, value in state_of(model, optimizer).items():
            if is_sharded(value):
                raise ValueError(f"{name!r} is sharded (tensor parallel?): dense_state "
                                 f"gathers only our FSDP's shards")
            if isinstance(value, torch.Tensor):
                dense[name] = value.detach().clone()
        return dense
    dense = {}
    for unit in model.units:
        for flat in unit.flats:
            dense.update(flat.full_tensors())  # FSDP's own gather
            moments = optimizer.state.get(flat.shard, {}) if optimizer is not None else {}
            for key, value in moments.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.shape == flat.shard.shape:  # a moment, sharded as the shard
                    dense.update({f"optim.{n}.{key}": t
                                  for n, t in _gathered(flat, value).items()})
                elif value.dim() == 0 and key == "step":
                    dense["optim.step"] = value.detach().clone()  # as state_of: one count
    return dense


def save_dense(dense, path, group=None):
    """Save ``dense`` ({name: whole tensor}, the same on every rank of ``group``) with DCP
    at the new directory ``path``, each tensor of one or more dims split by rows over the
    group (rank r keeps its own copy's row block r, so nothing is sent) and scalars as
    plain tensors (DCP writes those once)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    group = group if group is not None else dist.group.WORLD
    devices = {t.device.type for t in dense.values()}
    if len(devices) != 1:
        raise ValueError(f"the tensors of a dense state sit on one kind of device, not "
                         f"{sorted(devices)}")
    mesh = DeviceMesh.from_group(group, devices.pop())
    # src_data_rank=None: every rank already holds the whole tensor, each keeps its chunk
    state = {name: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) if t.dim()
             else t for name, t in dense.items()}
    dcp.save(state, checkpoint_id=str(path), process_group=group)


def empty_like_state(state, fill=float("nan")):
    """``state`` with every tensor and ShardedTensor replaced by a new one of the same
    box, filled with ``fill`` (NaN: a box that no load fills compares unequal)."""
    return map_state(state, lambda t: torch.full_like(t, fill) if t.is_floating_point()
                     else torch.zeros_like(t))


def dcp_boxes(path, state, group=None):
    """Fill ``state``'s tensors and ShardedTensors (in place) from the DCP checkpoint of
    whole tensors at ``path``: each name is loaded whole (DCP reassembles it from the
    saved blocks), then cut by the boxes. Plain values are left as they are. Every rank
    of ``group`` calls it (DCP plans its reads together); returns the names filled."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    wanted = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            shape, dtype = tuple(value.shape), value.dtype
        elif is_sharded(value):
            pieces = [value] if isinstance(value, ShardedTensor) else list(value)
            shape, dtype = pieces[0].global_shape, pieces[0].local.dtype
        else:
            continue
        entry = saved.get(name)
        if entry is None or not hasattr(entry, "size"):
            raise KeyError(f"the DCP checkpoint at {path} holds no tensor {name!r}")
        if tuple(entry.size) != shape or entry.properties.dtype != dtype:
            raise ValueError(f"{name!r}: DCP saved {tuple(entry.size)} "
                             f"{entry.properties.dtype}, the state holds {shape} {dtype}")
        wanted[name] = torch.empty(shape, dtype=dtype)
    dcp.load(wanted, checkpoint_id=str(path), process_group=group)
    with torch.no_grad():
        for name, whole in wanted.items():
            value = state[name]
            if isinstance(value, torch.Tensor):
                value.copy_(whole)
                continue
            for piece in [value] if isinstance(value, ShardedTensor) else value:
                box = tuple(slice(o, o + z) for o, z in zip(piece.offsets, piece.local.shape))
                piece.local.copy_(whole[box])
    return list(wanted)


__all__ = ["dense_state", "save_dense", "empty_like_state", "dcp_boxes"]
