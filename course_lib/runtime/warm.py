"""Warm ranks: torchrun jobs a kernel keeps, whose ranks stay up between calls.

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
- One warm job per (N, backend), at most ``COURSE_LIB_WARM_MAX`` of them per
  kernel (default 3: a check grades at two world sizes, the lab runs at a
  third); a call for yet another
  (N, backend) ends the least recently used. ``run(..., fresh=True)`` replaces
  the job it would have used.
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

    def __init__(self, nproc, backend, timeout, rules=False):
        self.nproc, self.backend, self.idle_s = nproc, backend, idle_limit_s()
        self.key = (nproc, backend, rules)
        # port 0: the kernel picks a free port, no probe-then-bind race
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        spec = {"mode": "serve", "timeout": max(float(timeout), 3600.0), "idle_s": self.idle_s,
                "nccl_rules": rules}
        self.job = Job(nproc, backend, spec, {"COURSE_LIB_STORE_PORT": str(self.store.port)})
        self.calls = 0
        self.last_used = time.monotonic()
        self.retired = False  # a call ended the default group: the ranks serve no more

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
_jobs: dict = {}  # (nproc, backend, NCCL rules) -> ServingJob, least recently used first
_timers: dict = {}


def max_jobs():
    """How many warm jobs a kernel keeps at once (``COURSE_LIB_WARM_MAX``, default 3):
    a check cell grades at two world sizes and the lab around it runs at NPROC;
    with one warm job, each of those calls would start its size afresh. Idle
    ranks cost memory (a few hundred MB each on CPU), not compute."""
    return max(1, int(os.environ.get("COURSE_LIB_WARM_MAX", "3")))


def acquire(nproc, backend, timeout, fresh=False, rules=False):
    """The warm job for (nproc, backend, NCCL's rules or not), started if there is none
    or it cannot serve; the caller owns it until :func:`release` or :func:`discard`."""
    key = (nproc, backend, rules)
    with _lock:
        job = _jobs.pop(key, None)
        _cancel_timer(job)
        # warm ranks turned off since the job was kept: it is not handed out again
        if job is not None and (fresh or not enabled() or not job.job.alive()
                                or time.monotonic() - job.last_used > job.idle_s):
            discard(job)
            job = None
        while len(_jobs) >= max_jobs():  # make room: end the least recently used
            discard(next(iter(_jobs.values())))
        if job is None:
            job = ServingJob(nproc, backend, timeout, rules)
        job.last_used = time.monotonic()  # in use: an idle timer firing now must not end it
        _jobs[key] = job
        return job


def release(job):
    """A call finished cleanly: keep the job warm (or end it when warm ranks are off, or
    when the call ended the default group and the ranks serve no more)."""
    with _lock:
        job.last_used = time.monotonic()
        if not enabled() or job.retired:
            discard(job)
        elif _jobs.get(job.key) is job:
            _arm_timer(job)


def discard(job):
    """End ``job`` and everything it started. Raises RuntimeError if a process survived."""
    with _lock:
        if _jobs.get(job.key) is job:
            del _jobs[job.key]
        _cancel_timer(job)
    job.stop()
    try:
        job.job.kill()
    finally:
        job.__dict__.pop("store", None)  # the last reference: closes the server socket


def current_job_ids():
    """The environment markers of this kernel's warm jobs."""
    with _lock:
        return {job.job.id for job in _jobs.values()}


def shutdown():
    """End this kernel's warm jobs (``course_lib.shutdown()``). Raises RuntimeError,
    after trying them all, if a process survived."""
    with _lock:
        jobs = list(_jobs.values())
    problems = []
    for job in jobs:
        try:
            discard(job)
        except RuntimeError as exc:
            problems.append(str(exc))
    if problems:
        raise RuntimeError("; ".join(problems))


def _arm_timer(job):
    timer = _timers[id(job)] = threading.Timer(job.idle_s, _expire, args=(job,))
    timer.daemon = True
    timer.start()


def _cancel_timer(job):
    timer = _timers.pop(id(job), None) if job is not None else None
    if timer is not None:
        timer.cancel()


def _expire(job):
    with _lock:
        if (_jobs.get(job.key) is job
                and time.monotonic() - job.last_used >= job.idle_s - 1):
            discard(job)


atexit.register(shutdown)
