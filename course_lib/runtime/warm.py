"""Warm ranks: one torchrun job per kernel whose ranks stay up between calls.

Starting a job costs seconds (torchrun, ``import torch`` in every rank, the
process group's rendezvous; NCCL communicators on a GPU node). The first
``run(fn, nproc=N, backend=B)`` of a kernel starts a job whose ranks, once
their process group is up, wait for work; later calls with the same N and
backend send the pickled function to those ranks and return in a fraction of
a second. It is a real torchrun job throughout.

- Each call starts from the state a fresh job would have
  (:mod:`course_lib.runtime.isolation`).
- Any failure, timeout or interrupt ends the job completely (a rank may be
  stuck inside a collective); the next call starts a fresh one.
- One warm job per kernel: a call with another N or backend replaces it.
  ``run(..., fresh=True)`` replaces it too.
- It ends with :func:`shutdown`, at interpreter exit, when the kernel dies
  (the ranks watch its pid) and after ``COURSE_LIB_WARM_IDLE_S`` seconds
  without a call (default 600), so a forgotten notebook does not hold GPUs.
- ``COURSE_LIB_WARM=0`` turns the feature off: every call is a fresh job,
  ended when the call returns.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from course_lib.runtime.job import Job

DEFAULT_IDLE_S = 600.0


def enabled():
    return os.environ.get("COURSE_LIB_WARM", "1").strip().lower() not in ("0", "false", "no", "off")


def idle_limit_s():
    return float(os.environ.get("COURSE_LIB_WARM_IDLE_S", DEFAULT_IDLE_S))


class ServingJob:
    """A :class:`Job` whose ranks serve calls, with the key-value store the
    notebook hands the calls out through."""

    def __init__(self, nproc, backend, timeout):
        self.nproc, self.backend, self.idle_s = nproc, backend, idle_limit_s()
        # port 0: the kernel picks a free port, no probe-then-bind race
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        spec = {"mode": "serve", "timeout": max(float(timeout), 3600.0), "idle_s": self.idle_s}
        self.job = Job(nproc, backend, spec, {"COURSE_LIB_STORE_PORT": str(self.store.port)})
        self.calls = 0
        self.last_used = time.monotonic()

    @property
    def dir(self):
        return self.job.dir

    def send(self, mode, payload):
        """Hand call number ``self.calls`` to the ranks; returns its number."""
        self.calls += 1
        (self.job.dir / f"task{self.calls}.pkl").write_bytes(payload)
        task = {"id": self.calls, "mode": mode, "cwd": os.getcwd()}
        self.store.set(f"task/{self.calls}", json.dumps(task))
        return self.calls

    def stop(self):
        """Ask idle ranks to leave (they are then killed with the rest of the job)."""
        try:
            self.store.set(f"task/{self.calls + 1}", json.dumps({"stop": True}))
        except Exception:  # noqa: BLE001 - the job is being ended anyway
            pass


_lock = threading.RLock()
_current: ServingJob | None = None
_timer: threading.Timer | None = None


def acquire(nproc, backend, timeout, fresh=False):
    """The warm job for (nproc, backend), started if there is none or it cannot
    serve; the caller owns it until :func:`release` or :func:`discard`."""
    global _current
    with _lock:
        _cancel_timer()
        job = _current
        stale = job is not None and (time.monotonic() - job.last_used > job.idle_s)
        if job is not None and (fresh or stale or not job.job.alive()
                                or (job.nproc, job.backend) != (nproc, backend)):
            discard(job)
            job = None
        if job is None:
            job = _current = ServingJob(nproc, backend, timeout)
        return job


def release(job):
    """A call finished cleanly: keep the job warm (or end it when warm ranks are off)."""
    with _lock:
        job.last_used = time.monotonic()
        if not enabled():
            discard(job)
        elif job is _current:
            _arm_timer(job)


def discard(job):
    """End ``job`` and everything it started. Raises RuntimeError if a process survived."""
    global _current
    with _lock:
        if job is _current:
            _current = None
            _cancel_timer()
    job.stop()
    try:
        job.job.kill()
    finally:
        job.__dict__.pop("store", None)  # the last reference: closes the server socket


def current_job_id():
    """The environment marker of this kernel's warm job, or None."""
    with _lock:
        return _current.job.id if _current is not None else None


def shutdown():
    """End this kernel's warm job, if any (``course_lib.shutdown()``)."""
    with _lock:
        job = _current
        if job is not None:
            discard(job)


def _arm_timer(job):
    global _timer
    _timer = threading.Timer(job.idle_s, _expire, args=(job,))
    _timer.daemon = True
    _timer.start()


def _cancel_timer():
    global _timer
    if _timer is not None:
        _timer.cancel()
        _timer = None


def _expire(job):
    with _lock:
        if job is _current and time.monotonic() - job.last_used >= job.idle_s - 1:
            discard(job)


atexit.register(shutdown)
