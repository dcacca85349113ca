"""What a rank of a job keeps up on its side of the pipe: its lines prefixed, its values
sent back on CPU, its files written whole, and its watch on the notebook kernel.

Used by :mod:`course_lib.runtime.worker` (what torchrun starts on every rank); the
notebook side reads what these write (:mod:`course_lib.runtime.output`,
:mod:`course_lib.runtime.job`).
"""
from __future__ import annotations

import io
import os
import threading
import time


class RankPrefixed(io.TextIOBase):
    """A text stream that writes whole lines, each prefixed, in one write call
    (writes up to PIPE_BUF are atomic, so ranks' lines do not interleave)."""

    def __init__(self, stream, prefix):
        self._stream, self._prefix, self._partial = stream, prefix, ""
        self._lock = threading.Lock()

    def writable(self):
        return True

    def write(self, text):
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
            if lines:
                self._stream.write("".join(f"{self._prefix}{ln}\n" for ln in lines))
                self._stream.flush()
        return len(text)

    def flush(self):
        with self._lock:
            if self._partial:
                self._stream.write(f"{self._prefix}{self._partial}\n")
                self._partial = ""
            self._stream.flush()


def watch_launcher(pid, job, rank, forked):
    """End this rank if the notebook kernel that launched it has gone. Its folder
    goes too: removed by the agent once every rank has ended (forked ranks), or
    else by rank 0 (torchrun keeps nothing there once its ranks are gone)."""
    while True:
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            if not forked:
                remove_orphaned_folder(job, rank)
            os._exit(3)
        except PermissionError:
            pass


def remove_orphaned_folder(job, rank):
    """Rank 0 of a torchrun job whose kernel has gone removes the job's folder, once the
    other ranks have ended (torchrun died with the kernel, and its store with it: the
    ranks' next read fails, often before their watcher notices)."""
    from course_lib.runtime import folders, procs

    if rank != 0 or folders.launcher_alive(job):
        return
    import psutil

    others = []
    for pid in folders.rank_pids(job):
        try:
            if pid != os.getpid():
                others.append(psutil.Process(pid))
        except psutil.Error:
            continue
    procs.wait_dead(others, 10)
    folders.remove_folder(job)


def map_tensors(fn, value):
    """``value`` with ``fn`` applied to every tensor inside it, whatever the
    nesting: lists, tuples, dicts, OrderedDicts and namedtuples (through
    ``torch.utils._pytree``) and dataclasses (field by field)."""
    import dataclasses

    import torch
    from torch.utils import _pytree as pytree

    def leaf(x):
        if isinstance(x, torch.Tensor):
            return fn(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            changes = {f.name: map_tensors(fn, getattr(x, f.name))
                       for f in dataclasses.fields(x) if f.init}
            return dataclasses.replace(x, **changes)
        return x

    return pytree.tree_map(leaf, value)


def to_cpu(value):
    """Everything a rank returns travels to the notebook on CPU, detached."""
    return map_tensors(_to_cpu_tensor, value)


def _to_cpu_tensor(t):
    import torch

    moved = t.detach()
    moved = moved.cpu() if isinstance(moved, torch.Tensor) else moved
    if not isinstance(moved, torch.Tensor):  # a subclass's __torch_function__ answered
        kind = f"{type(t).__module__}.{type(t).__qualname__}"
        raise TypeError(f"the function returned a {kind}, a subclass of torch.Tensor whose "
                        f"detach().cpu() gave a {type(moved).__name__}: return a plain tensor")
    return moved


def write_whole(path, data):
    """``data`` to ``path`` under a temporary name, then renamed: a rank ended halfway
    (torchrun ends the others as soon as one fails) never leaves half a file."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_bytes(data)
    os.replace(partial, path)
