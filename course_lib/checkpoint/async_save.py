"""Saving while training goes on (Lab 08): the loop waits only for a copy of the state.

A synchronous save blocks the training loop for as long as the disk takes. An
asynchronous one blocks it only to copy the state off the GPU (into pinned memory on
CUDA, a plain copy on the CPU) and to agree on the index's contents (one gather); a
background thread then writes the data file, and rank 0's thread waits for every rank's
data file to appear (a rename makes each appear whole) before it writes the index and
the commit marker. No collective runs off the main thread: two threads issuing
collectives on one communicator can deadlock on NCCL.

A second save waits for the first (``wait()``), so at most one copy of the state is in
flight. A rank's ``wait()`` returns when its own data is on disk; rank 0's, when the
checkpoint is committed::

    saver = AsyncCheckpointer()
    for step in range(steps):
        train_step()
        if step % every == 0:
            saver.save(state_of(model, optimizer), f"ckpt/step_{step:06d}")
    saver.wait()
"""
from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.checkpoint.boxes import map_state
from course_lib.checkpoint.files import CheckpointError, data_file
from course_lib.checkpoint.save import commit, layout, refuse_committed, write_data
from course_lib.runtime.device import sync


def _copy(tensor):
    tensor = tensor.detach()
    if tensor.is_cuda:  # pinned: the copy to the host runs at full PCIe speed
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor)
    return tensor.clone()


def snapshot(state):
    """``state`` with every tensor copied to the host, so that training may change it."""
    return map_state(state, _copy, copy.deepcopy)


class AsyncCheckpointer:
    """Saves in the background; ``blocked_s`` is the time the last ``save`` call took."""

    def __init__(self, timeout=600.0):
        self.timeout, self.blocked_s = timeout, 0.0
        self._thread, self._error = None, None

    def save(self, state, path, group=None):
        """Copy ``state``, agree on the index, start the writing; returns the bytes this
        rank's data file will hold."""
        self.wait()
        started = time.perf_counter()
        path = Path(path)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        refuse_committed(path)
        path.mkdir(parents=True, exist_ok=True)
        # a data file left by a save that died must not pass for this one's
        (path / data_file(rank)).unlink(missing_ok=True)
        tensors, described, values = layout(snapshot(state), path, rank)
        sync()  # the pinned copies are complete before the thread reads (nothing on CPU ranks)
        everyone = [None] * world
        dist.all_gather_object(everyone, described, group=group)  # also: stale files gone
        self._thread = threading.Thread(target=self._write, daemon=True, name="checkpoint",
                                        args=(path, rank, world, tensors, everyone, values))
        self._thread.start()
        self.blocked_s = time.perf_counter() - started
        return sum(t.numel() * t.element_size() for t in tensors)  # as save(): this rank's

    def _write(self, path, rank, world, tensors, everyone, values):
        try:
            write_data(path, rank, tensors)
            if rank == 0:
                deadline = time.monotonic() + self.timeout
                files = [path / data_file(r) for r in range(world)]
                while not all(f.is_file() for f in files):
                    if time.monotonic() > deadline:
                        missing = [f.name for f in files if not f.is_file()]
                        raise CheckpointError(f"{path}: no data from {missing} after "
                                              f"{self.timeout:g} s; not committed")
                    time.sleep(0.01)
                commit(path, everyone, values)
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop in wait()
            self._error = exc

    def wait(self):
        """Block until the save in flight is written (and, on rank 0, committed); raise
        what went wrong in it."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
