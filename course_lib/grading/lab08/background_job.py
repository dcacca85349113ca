"""Exercise 8.6's job, what runs on the ranks: the student's ``AsyncSaver`` through the
six steps :mod:`course_lib.grading.lab08.background` lists, with course_lib's file writes
held at a gate, an uneven disk, a full one, and every ``torch.distributed`` call made off
the main thread noted. It returns what each rank saw; the verdict is the check's.
"""
from __future__ import annotations

import importlib
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from course_lib.checkpoint.files import data_file, is_committed
from course_lib.checkpoint.load import consolidate
from course_lib.grading.lab08.atomic import _attempt, _files, _state

EX_ASYNC = "Exercise 8.6"
N, LATE_S, GATE_S, TIMEOUT_S, HANG_S, RESAVE_LATE_S = 3, 0.3, 1.5, 5.0, 15.0, 0.6
FULL = "No space left on device (the check's disk is full)"
WATCHED = ("all_gather_object", "gather_object", "broadcast_object_list", "barrier",
           "all_gather", "all_reduce", "broadcast", "gather", "scatter", "reduce_scatter",
           "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all_single",
           "all_to_all", "monitored_barrier", "reduce", "scatter_object_list")

__all__ = ["async_job"]


@contextmanager
def _watched(rank, gate, disk):
    """The gate on background writes, the late disk (``disk["late"]``: seconds to add to
    this rank's next data files), the full one (rank 1's, under ``disk["failing"]``), and
    a note of every collective called off the main thread (but by the check's own)."""
    # the module, not the function course_lib.checkpoint exports under the same name
    save_module = importlib.import_module("course_lib.checkpoint.save")

    real_write, seen = save_module.write_atomically, {"off_main": set(), "exempt": set()}
    main = threading.main_thread()

    def write_atomically(path, data):
        if threading.current_thread() is not main:
            if not gate.wait(60):
                raise TimeoutError("the check's gate never opened")
            if Path(path).parent == disk["failing"] and rank == 1:
                raise OSError(FULL)
            if disk["late"] and Path(path).name == data_file(rank):
                time.sleep(disk["late"].pop())
        return real_write(path, data)

    def noting(name, fn):
        def call(*args, **kwargs):
            if threading.current_thread() is not main \
                    and threading.get_ident() not in seen["exempt"]:
                seen["off_main"].add(name)
            return fn(*args, **kwargs)
        return call

    real = {name: getattr(dist, name) for name in WATCHED if hasattr(dist, name)}
    save_module.write_atomically = write_atomically
    for name, fn in real.items():
        setattr(dist, name, noting(name, fn))
    try:
        yield seen
    finally:
        save_module.write_atomically = real_write
        for name, fn in real.items():
            setattr(dist, name, fn)


def _waited(saver, seen):
    """``_attempt(saver.wait)``, or {"hung": True} if it is still waiting after HANG_S.
    The check's waiting thread stands for the loop's: its collectives are not noted."""
    result = {}

    def waiting():
        seen["exempt"].add(threading.get_ident())
        result.update(_attempt(saver.wait))

    thread = threading.Thread(target=waiting, daemon=True)
    thread.start()
    thread.join(HANG_S)
    return {"hung": True} if thread.is_alive() else result


def _changed(state):
    """What the next training step does to a state the save was handed."""
    state["w"].local.add_(1000)
    state["bias"].add_(1000)
    state["losses"].append(0.0)
    state["step"] = -1  # a plain value replaced, not changed in place: no trace


def async_job(saver_class):
    """On every rank: what it saw of the saves, for the check (rank 0 also reports the
    files and what course_lib's load reads back)."""
    rank = dist.get_rank()
    name = [tempfile.mkdtemp(prefix="lab08-async-") if rank == 0 else None]
    dist.broadcast_object_list(name, group_src=0)
    root, out, ended = Path(name[0]), {}, False
    a, b, c = root / "step_000100", root / "step_000200", root / "step_000300"
    gate, disk = threading.Event(), {"failing": c, "late": [LATE_S * rank]}
    try:
        with _watched(rank, gate, disk) as seen:
            saver = saver_class(timeout=TIMEOUT_S)
            state = _state(rank, N)
            out["returned"] = saver.save(state, a)
            out["data_on_return"] = (a / data_file(rank)).exists()
            _changed(state)
            opener = threading.Timer(GATE_S, gate.set)
            opener.start()
            saver.save(_state(rank, N), b)
            out["first_written"] = (a / data_file(rank)).exists()
            out["first_committed"] = is_committed(a)
            gate.set()  # a save that did not wait must not wait for the timer either
            out["wait"] = _attempt(saver.wait)
            out["committed_after_wait"] = is_committed(b)
            dist.barrier()
            if rank == 0:
                out["a"] = {"files": _files(a), "whole": _attempt(consolidate, a)}
                out["b"] = {"files": _files(b), "whole": _attempt(consolidate, b)}
            dist.barrier()
            out["full"] = _attempt(saver.save, _state(rank, N), c)
            out["full_wait"] = _waited(saver, seen)
            hung = [bool(out["full_wait"].get("hung"))]
            dist.broadcast_object_list(hung, group_src=0)
            if not hung[0]:  # a saver still waiting would hang the next save: verdict given
                out["again"] = _attempt(saver.save, _state(rank, N), b)
                out["again_wait"] = _attempt(saver.wait)
            dist.barrier()
            if rank == 0:
                out["b_after"] = _files(b)
            # step 6 only after a step 5 every rank refused for the right reason: a rank that
            # re-raised an old error skips the gather the others wait in
            why = out.get("again", {}).get("error", "")
            fine = [bool(why) and FULL not in why and "rank00001.bin" not in why]
            every = [None] * N
            dist.all_gather_object(every, fine[0])
            if all(every):  # into the failed save's directory, its files still there
                disk["failing"] = None
                disk["late"][:] = [RESAVE_LATE_S] if rank == 2 else []
                out["resave"] = _attempt(saver.save, _state(rank, N), c)
                out["resave_wait"] = _waited(saver, seen)
            dist.barrier()
            if rank == 0 and all(every):
                out["c"] = {"files": _files(c), "whole": _attempt(consolidate, c)}
            out["off_main"] = sorted(seen["off_main"])
        ended = True
        return out
    finally:
        gate.set()
        if ended:
            dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
