"""A rank's faulthandler dump, parsed: its threads, each a list of :class:`Frame`.

faulthandler writes, per thread, "Thread 0x... (most recent call first):" ("Current
thread ..." for the one that took the signal, "Stack ..." with a single thread), then
one line per frame, innermost first: '  File "path", line N in func'. A frame knows
where it comes from (the student's code, the launcher, the checker, the library,
torch, Python) and which communication call it is, if any;
:mod:`course_lib.runtime.stacks` reads a rank's state from the frames.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

_FRAME_LINE = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*?)\s*$')
_THREAD_LINE = re.compile(r"^(Current thread|Thread|Stack)\b.*:$")
_PACKAGE = Path(__file__).resolve().parents[1]  # the course_lib folder the ranks import too
_STDLIB = re.compile(r"/lib/python\d+(\.\d+)?t?/(?!(site|dist)-packages/)")
_SITE = re.compile(r"/(site|dist)-packages/")

# The calls a rank can wait in, by name (leading underscores ignored: a collective run
# on a helper thread shows as ``_all_reduce``).
COLLECTIVE_OPS = frozenset({
    "all_reduce", "all_reduce_coalesced", "broadcast", "broadcast_object_list", "all_gather",
    "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "reduce_scatter",
    "reduce_scatter_tensor", "reduce", "gather", "gather_object", "scatter",
    "scatter_object_list", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "new_group", "naive_all_reduce", "ring_broadcast", "pipelined_broadcast"})
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "exchange",
                     "exchange_async", "send_object_list", "recv_object_list"})
WAIT_OPS = frozenset({"wait", "wait_all"})
_RULES = "course_lib.runtime.nccl_rules"


@functools.lru_cache(maxsize=1024)
def _course_lib_module(path):
    """``course_lib.x.y`` for a file of this package (wherever it was imported from:
    the ranks import the notebook's copy), else None."""
    if "/course_lib/" not in path or not path.endswith(".py"):
        return None
    rest = path.rsplit("/course_lib/", 1)[1]
    if not (_PACKAGE / rest).is_file():  # a folder that only has the same name
        return None
    return "course_lib." + rest[:-3].replace("/", ".")


@dataclass(frozen=True)
class Frame:
    """One frame of a stack dump."""
    file: str
    line: int
    func: str

    @property
    def path(self):
        return self.file.replace("\\", "/")

    @property
    def origin(self):
        """``user`` (the student's code: a notebook cell, a script, the file of a
        pickled function), ``grading`` and ``runtime`` (the checker, the launcher),
        ``course_lib`` (the rest of the library), ``torch``, ``library`` (other
        installed packages) or ``python`` (the standard library)."""
        module = _course_lib_module(self.path)
        if module is not None:
            part = module.split(".")[1]
            return part if part in ("grading", "runtime") else "course_lib"
        if self.path.startswith("<frozen") or _STDLIB.search(self.path):
            return "python"
        found = _SITE.search(self.path)
        if found:
            return "torch" if self.path[found.end():].startswith("torch/") else "library"
        return "user"

    @property
    def library(self):
        """The module a student would name: course_lib.comm, torch.distributed, ..."""
        module = _course_lib_module(self.path)
        if module is not None:
            return ".".join(module.split(".")[:2])
        found = _SITE.search(self.path)
        if found:
            parts = self.path[found.end():].split("/")
            return ".".join(parts[:2] if parts[0] == "torch" and len(parts) > 2 else parts[:1])
        return self.path.rsplit("/", 1)[-1]

    def short(self):
        """Library files from their package down (course_lib/comm.py, torch/...)."""
        if _course_lib_module(self.path) is not None:
            return "course_lib/" + self.path.rsplit("/course_lib/", 1)[1]
        found = _SITE.search(self.path)
        return self.path[found.end():] if found else self.file

    def op(self):
        """The communication call this frame is (``all_reduce``, ``recv``, ``wait``...),
        or None. Only the library's frames count (course_lib's, torch.distributed's and
        torch.futures'): not the checker's wrappers around them, nor the student's own
        functions of the same name."""
        origin = self.origin
        if origin == "torch":
            if not re.search(r"/torch/(distributed|futures)/", self.path):
                return None
        elif origin != "course_lib" and _course_lib_module(self.path) != _RULES:
            return None  # (NCCL's rules wait for the other ranks in a frame named after the op)
        name = self.func.lstrip("_")
        return name if name in COLLECTIVE_OPS or name in P2P_OPS or name in WAIT_OPS else None


def parse_dump(text):
    """``[(is_current, frames)]``, one per thread of a faulthandler dump, frames outermost
    first."""
    threads, frames, current = [], None, False
    for line in (text or "").splitlines():
        if _THREAD_LINE.match(line.strip()):
            if frames is not None:
                threads.append((current, frames[::-1]))
            frames, current = [], line.strip().startswith("Current")
            continue
        found = _FRAME_LINE.match(line)
        if found:
            frames = [] if frames is None else frames
            frames.append(Frame(found["file"], int(found["line"]), found["func"]))
    if frames is not None:
        threads.append((current, frames[::-1]))
    return threads


def started_by_threading(frames):
    return bool(frames) and frames[0].origin == "python" and frames[0].func == "_bootstrap"


def main_thread(threads):
    """The frames of the thread that runs the rank's program: the one ``threading`` did
    not start (the signal's thread, "Current thread", is not always the main one)."""
    mains = [(not cur, frames) for cur, frames in threads if not started_by_threading(frames)]
    if not mains:
        mains = [(not cur, frames) for cur, frames in threads]
    return min(mains, key=lambda m: m[0])[1] if mains else []


def first_op(frames):
    """``(index, op)`` of the outermost communication call in ``frames``, or (None, None)."""
    for i, frame in enumerate(frames):
        op = frame.op()
        if op is not None:
            return i, op
    return None, None


def op_kind(op):
    return "collective" if op in COLLECTIVE_OPS else "p2p" if op in P2P_OPS else "wait"


def from_the_worker(frames):
    """A rank's main thread from the worker's ``main`` in (outermost first): what
    started the rank (torchrun's agent forking it, multiprocessing) is left out."""
    for at, frame in enumerate(frames or ()):
        if frame.func == "main" and frame.path.endswith("runtime/worker.py"):
            return frames[at:]
    return frames
