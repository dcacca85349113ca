"""Load a sharded checkpoint into any layout (Lab 08).

For each tensor the state asks for, each box this rank wants (the whole tensor for a
plain tensor; the boxes of its ShardedTensors) is intersected with every saved piece
(:func:`~course_lib.checkpoint.boxes.overlap`); from each piece that overlaps, only the
byte runs of the overlap are read (:func:`~course_lib.checkpoint.boxes.byte_ranges`),
so a rank reads the bytes its boxes hold and no more, whatever world size or split saved
them. Nothing is written: a load that fails, or dies, leaves the checkpoint as it was::

    state = {"model": ShardedTensor(torch.empty(1024, 4096), (4096, 4096), (0, rank * 1024))}
    bytes_read = load(state, latest("ckpt"))       # fills state's tensors, sets its values
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from course_lib.checkpoint.boxes import ShardedTensor, byte_ranges, is_sharded, overlap
from course_lib.checkpoint.files import CheckpointError, dtype_of, read_index


def _wanted(value):
    """[(destination tensor, box)] for one entry of the state."""
    if isinstance(value, torch.Tensor):
        return [(value, ((0,) * value.dim(), tuple(value.shape)))], tuple(value.shape)
    shards = [value] if isinstance(value, ShardedTensor) else list(value)
    shapes = {s.global_shape for s in shards}
    if len(shapes) > 1:
        raise ValueError(f"one name's ShardedTensors disagree on the global shape: {shapes}")
    return [(s.local, s.box) for s in shards], shapes.pop() if shapes else None


def load(state, path, group=None, fill=None):
    """Fill ``state``'s tensors and ShardedTensors in place and set its plain values
    from the checkpoint at ``path``; returns the bytes this rank read. ``group`` is
    accepted for symmetry with save: a load needs no communication. ``fill`` fills one
    box from the saved pieces (:func:`fill_box` unless given: Lab 08's Exercise 8.4)."""
    path = Path(path)
    index = read_index(path)
    read = 0
    for name, value in state.items():
        if isinstance(value, torch.Tensor) or is_sharded(value):
            read += _load_tensor(path, index, name, value, fill or fill_box)
        elif name in index["values"]:
            state[name] = index["values"][name]
        else:
            raise CheckpointError(f"{path} holds no value {name!r} (it has "
                                  f"{sorted(index['values']) + sorted(index['tensors'])})")
    return read


def _load_tensor(path, index, name, value, fill):
    entry = index["tensors"].get(name)
    if entry is None:
        raise CheckpointError(f"{path} holds no tensor {name!r} (it has "
                              f"{sorted(index['tensors'])})")
    wanted, shape = _wanted(value)
    dtype = dtype_of(entry["dtype"])
    if shape is not None and tuple(shape) != tuple(entry["shape"]):
        raise CheckpointError(f"{path}: {name!r} was saved with shape {tuple(entry['shape'])}, "
                              f"the state asks for {tuple(shape)}")
    read = 0
    for destination, box in wanted:
        if destination.dtype != dtype:
            raise CheckpointError(f"{path}: {name!r} was saved as {dtype}, the state holds "
                                  f"{destination.dtype}")
        try:
            read += fill(path, entry, destination, box)
        except CheckpointError as exc:  # say which tensor
            raise CheckpointError(f"{exc} (tensor {name!r})") from None
    return read


def fill_box(path, entry, destination, box):
    """Fill ``destination`` (this rank's tensor of the box ``box`` = (offsets, sizes) of
    a global tensor) from the saved pieces of that tensor, ``entry`` being its index
    entry (``shape``, ``dtype``, ``pieces``: each with ``file``, ``byte_offset``,
    ``offsets``, ``sizes``): for every piece, the overlap with the box, read as byte runs
    of the piece's row-major array in its file. Returns the bytes read."""
    dtype = dtype_of(entry["dtype"])
    read = filled = 0
    for piece in entry["pieces"]:
        stored = (tuple(piece["offsets"]), tuple(piece["sizes"]))
        common = overlap(stored, box)
        if common is None:
            continue
        where = tuple(slice(o - b, o - b + z) for o, b, z in zip(common[0], box[0], common[1]))
        target = destination[where]
        direct = target.is_contiguous() and target.device.type == "cpu"
        with torch.no_grad():
            block = _read(path / piece["file"], piece["byte_offset"], stored, common, dtype,
                          out=target if direct else None)
            if not direct:
                target.copy_(block)
        read += block.numel() * block.element_size()
        filled += block.numel()
    if filled != math.prod(box[1]):
        raise CheckpointError(f"{path}: the saved pieces cover {filled} of the "
                              f"{math.prod(box[1])} elements of box {box}")
    return read


def _read(file, base, stored, common, dtype, out=None):
    """The overlap ``common`` of the piece ``stored`` (at byte ``base`` of ``file``),
    read straight into ``out`` (a contiguous host tensor of its shape) or a new tensor."""
    block = torch.empty(common[1], dtype=dtype) if out is None else out
    if block.numel() == 0:
        return block
    into = memoryview(block.reshape(-1).view(torch.uint8).numpy())
    at = 0
    with open(file, "rb", buffering=0) as f:
        for start, length in byte_ranges(stored, common, block.element_size()):
            f.seek(base + start)
            while length:  # a raw read may return less than asked
                got = f.readinto(into[at:at + length])
                if not got:
                    raise CheckpointError(f"{file} ends before byte {base + start + length}: "
                                          f"the checkpoint is damaged")
                at, start, length = at + got, start + got, length - got
    return block


def consolidate(path):
    """{name: whole tensor (CPU), or plain value} of the checkpoint at ``path``, in this
    process (to hand a model to someone with one GPU)."""
    index = read_index(path)
    state = {name: torch.empty(entry["shape"], dtype=dtype_of(entry["dtype"]))
             for name, entry in index["tensors"].items()}
    state.update({name: None for name in index["values"]})
    load(state, path)
    return state
