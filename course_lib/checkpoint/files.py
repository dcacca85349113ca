"""The files of one checkpoint directory, and writing them so that a crash cannot leave
a half-written file under its final name (Lab 08).

    rank00003.bin   the bytes of rank 3's boxes, one after the other (row-major)
    index.json      every tensor: global shape, dtype, and its pieces (rank, file, box,
                    byte offset and length); plain values (a step, a list of losses)
    COMMITTED       written last, once the index is on disk: the checkpoint exists

A file is written under a temporary name, flushed to the disk (fsync) and renamed: a
rename within one directory is atomic, so a reader sees the old state or the new one.
The directory is fsynced after a rename so that the new name itself survives a crash.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

INDEX, COMMITTED = "index.json", "COMMITTED"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as asked; the message names it."""


def dtype_of(name):
    """The torch dtype an index names (``"float32"`` -> ``torch.float32``)."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{name!r} names no torch dtype")
    return dtype


def data_file(rank):
    return f"rank{rank:05d}.bin"


def write_atomically(path, data):
    """``data`` (bytes, or an iterable of buffers written one after the other, so that
    tensors need not be joined into one copy first) at ``path``, all or nothing."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        for chunk in [data] if isinstance(data, (bytes, bytearray)) else data:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    sync_directory(path.parent)


def sync_directory(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_committed(path):
    return (Path(path) / COMMITTED).is_file()


def read_index(path):
    """The index of the committed checkpoint at ``path`` (CheckpointError otherwise)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
    if not is_committed(path):
        raise CheckpointError(f"{path} holds no committed checkpoint (no {COMMITTED} marker: "
                              f"its save did not finish); load the previous one (latest())")
    return json.loads((path / INDEX).read_text())
