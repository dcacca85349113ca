"""Save a sharded state: every rank writes its own boxes, then rank 0 writes the index
and the commit marker (Lab 08).

``state`` maps names to

- a tensor: replicated (every rank holds the same), written once, by the group's rank 0;
- a :class:`~course_lib.checkpoint.boxes.ShardedTensor`, or a list of them (several
  boxes of one tensor on this rank, an FSDP flat range say): each rank writes its own
  (a rank that holds none of the tensor passes a ShardedTensor with a size-0 box);
- a plain value that JSON can hold (a step, a list of losses): rank 0's is kept.

The order makes a save atomic. Each rank writes its data file (temporary name, fsync,
rename); the ranks then hand their pieces' descriptions to rank 0 (a gather, which is
also the barrier: no index before every rank's data is on disk); rank 0 writes the index,
then the marker ``COMMITTED``. A save that dies anywhere before the marker leaves a
directory that :func:`latest` and :func:`~course_lib.checkpoint.load.load` refuse, and
every earlier checkpoint as it was. A directory already committed is never written into::

    save({"model": ShardedTensor(shard, (4096, 1024), (rank * 1024, 0)), "step": 100},
         f"ckpt/step_{100:06d}", group=dp_group)
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.checkpoint.boxes import ShardedTensor, is_sharded
from course_lib.checkpoint.files import (COMMITTED, INDEX, CheckpointError, data_file,
                                         is_committed, write_atomically)


def _as_buffer(tensor):
    """The tensor's bytes, without a copy when it is already contiguous on the host."""
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return memoryview(flat.view(torch.uint8).numpy())


def _pieces(name, value, rank):
    """[(ShardedTensor, bytes)] this rank writes for ``name``."""
    if isinstance(value, torch.Tensor):
        whole = ShardedTensor(value, tuple(value.shape), (0,) * value.dim())
        return [whole] if rank == 0 else []
    if isinstance(value, ShardedTensor):
        return [value]
    return list(value)


def _is_tensor_entry(value):
    return isinstance(value, torch.Tensor) or is_sharded(value)


def refuse_committed(path):
    """Raise :class:`CheckpointError` if ``path`` holds a committed checkpoint (a save
    never writes into one)."""
    if is_committed(path):  # the same answer on every rank: they share the directory
        raise CheckpointError(f"{path} already holds a committed checkpoint: a save never "
                              f"overwrites one; save to a new directory")


def layout(state, path, rank):
    """(the tensors this rank writes, in order; their descriptions for the index, a list
    of dicts; the plain values, a dict) of ``state``, for rank ``rank`` of the group
    that saves (a replicated tensor is rank 0's to write)."""
    tensors, described, values, at = [], [], {}, 0
    for name, value in state.items():
        if not _is_tensor_entry(value):
            try:
                values[name] = json.loads(json.dumps(value))
            except TypeError as exc:
                raise CheckpointError(f"{path}: {name!r} is neither a tensor, a ShardedTensor "
                                      f"nor a plain value JSON can hold ({exc})") from None
            continue
        for piece in _pieces(name, value, rank):
            nbytes = piece.local.numel() * piece.local.element_size()
            described.append({"name": name, "shape": list(piece.global_shape),
                              "dtype": str(piece.local.dtype).removeprefix("torch."),
                              "rank": rank, "file": data_file(rank),
                              "offsets": list(piece.offsets), "sizes": list(piece.local.shape),
                              "byte_offset": at, "nbytes": nbytes})
            tensors.append(piece.local)
            at += nbytes
    return tensors, described, values


def write_data(path, rank, tensors):
    """This rank's data file in ``path``: ``tensors`` one after the other, written under a
    temporary name, fsynced, then renamed (whole or absent)."""
    write_atomically(Path(path) / data_file(rank), (_as_buffer(t) for t in tensors))


def commit(path, everyone, values, on_stage=None):
    """Rank 0, once every rank's data is on disk: the index, then the marker.
    ``everyone[r]`` is the description list ``layout`` gave group rank ``r``; ``values``
    the plain values."""
    write_atomically(Path(path) / INDEX, json.dumps(_index(path, everyone, values)).encode())
    _stage(on_stage, "index")
    write_atomically(Path(path) / COMMITTED, b"")
    _stage(on_stage, "commit")


def save(state, path, group=None, on_stage=None, local=False):
    """Write ``state`` (see the module) to the new directory ``path`` on every rank of
    ``group``; returns the bytes this rank wrote. ``local=True``: this process alone, no
    communication (a pipeline stage saving on its own). ``on_stage(stage)`` is called
    after "data", "index" and "commit" (the last two on rank 0): the tests kill a rank
    there."""
    path = Path(path)
    rank = 0 if local else dist.get_rank(group)
    refuse_committed(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, described, values = layout(state, path, rank)
    write_data(path, rank, tensors)
    _stage(on_stage, "data")
    if local:
        everyone = [described]
    else:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, described, group=group)  # every rank's data is on disk
    if rank == 0:
        commit(path, everyone, values, on_stage)
    if not local:
        dist.barrier(group=group)  # nobody returns before the checkpoint exists
    return sum(d["nbytes"] for d in described)


def _stage(on_stage, stage):
    if on_stage is not None:
        on_stage(stage)


def _index(path, everyone, values):
    tensors = {}
    for piece in (p for pieces in everyone for p in pieces):
        entry = tensors.setdefault(piece["name"], {"shape": piece["shape"],
                                                  "dtype": piece["dtype"], "pieces": []})
        if (entry["shape"], entry["dtype"]) != (piece["shape"], piece["dtype"]):
            raise CheckpointError(f"{path}: the ranks disagree on {piece['name']!r}: shape "
                                  f"{entry['shape']} {entry['dtype']} on one, "
                                  f"{piece['shape']} {piece['dtype']} on rank {piece['rank']}")
        entry["pieces"].append({k: piece[k] for k in ("rank", "file", "offsets", "sizes",
                                                      "byte_offset", "nbytes")})
    return {"version": 1, "world": len(everyone), "tensors": tensors, "values": values}


def latest(root):
    """The committed checkpoint directory under ``root`` with the highest step (the last
    number in its name), or None; a directory whose save died is never returned."""
    root = Path(root)
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        numbers = re.findall(r"\d+", child.name)
        if child.is_dir() and numbers and (child / COMMITTED).is_file():
            found.append((int(numbers[-1]), child))
    return max(found)[1] if found else None
