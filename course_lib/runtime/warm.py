"""Warm ranks: torchrun jobs a kernel keeps, whose ranks stay up between calls.

Starting a job costs seconds (torchrun, ``import torch`` in every rank, the
process group's rendezvous; NCCL communicators on a GPU node). The first
``run(fn, nproc=N, backend=B)`` of a kernel starts a job whose ranks, once
their process group is up, wait for work; later calls with the same N and
backend send the pickled function to those ranks and return in a fraction of
a second. It is a real torchrun job throughout. The pool only keeps and hands out
jobs (:class:`~course_lib.runtime.job.Job`); a job runs its calls, and ends itself when one
fails.

- Each call starts from the state a fresh job would have
  (:mod:`course_lib.runtime.isolation`).
- Any failure, timeout or interrupt ends the job completely (a rank may be
  stuck inside a collective); the next call starts a fresh one.
- One warm job per (N, backend, NCCL's rules or not), at most ``COURSE_LIB_WARM_MAX``
  of them per kernel (default 4: a check grades at world sizes 1, 2 and 3, the lab runs
  at a fourth); a call for yet another ends the least recently used.
  ``run(..., fresh=True)`` replaces the job it would have used.
- It ends with :func:`shutdown`, at interpreter exit, when the kernel dies
  (the ranks watch its pid) and after ``COURSE_LIB_WARM_IDLE_S`` seconds
  without a call (default 600), so a forgotten notebook does not hold GPUs.
- ``COURSE_LIB_WARM=0`` turns the feature off: every call is a fresh job,
  ended when the call returns.
"""
from __future__ import annotations

import atexit
import os
import threading
import time

from course_lib.runtime.job import Job

DEFAULT_IDLE_S = 600.0


def enabled():
    return os.environ.get("COURSE_LIB_WARM", "1").strip().lower() not in ("0", "false", "no", "off")


def idle_limit_s():
    return float(os.environ.get("COURSE_LIB_WARM_IDLE_S", DEFAULT_IDLE_S))


_lock = threading.RLock()
_jobs: dict = {}  # (nproc, backend, NCCL rules) -> serving Job, least recently used first
_last_used: dict = {}  # Job.id -> time.monotonic() of its last call
_timers: dict = {}  # Job.id -> the idle timer armed when its last call returned


def max_jobs():
    """How many warm jobs a kernel keeps at once (``COURSE_LIB_WARM_MAX``, default 4):
    a check cell grades at world sizes 1, 2 and 3 and the lab around it runs at NPROC.
    Least-recently-used with one slot fewer than the sizes in turn ends every job
    just before it is wanted again, and each call starts its size afresh (with 3,
    the nine solution notebooks ran 12% longer). Idle ranks cost memory (a few
    hundred MB each on CPU), not compute."""
    return max(1, int(os.environ.get("COURSE_LIB_WARM_MAX", "4")))


def acquire(nproc, backend, timeout, fresh=False, rules=False):
    """The serving :class:`Job` for (nproc, backend, NCCL's rules or not), started if there
    is none or it cannot serve; the caller owns it until it hands it to :func:`release`."""
    key = (nproc, backend, bool(rules))
    with _lock:
        job = _jobs.pop(key, None)
        _cancel_timer(job)
        # warm ranks turned off since the job was kept: it is not handed out again
        if job is not None and (fresh or not enabled() or not job.reusable()
                                or time.monotonic() - _last_used[job.id] > job.idle_s):
            discard(job)
            job = None
        while len(_jobs) >= max_jobs():  # make room: end the least recently used
            discard(next(iter(_jobs.values())))
        if job is None:
            job = Job(nproc, backend, "serve", timeout, rules, idle_s=idle_limit_s())
        _last_used[job.id] = time.monotonic()  # in use: an idle timer firing must not end it
        _jobs[key] = job
        return job


def release(job):
    """A call returned or failed: keep the job warm if it can serve again, else forget it
    (and end it, if its failure had not ended it already)."""
    with _lock:
        _last_used[job.id] = time.monotonic()
        if not enabled() or not job.reusable():
            discard(job)
        elif _jobs.get(_key(job)) is job:
            _arm_timer(job)


def _key(job):
    return (job.nproc, job.backend, job.rules)


def discard(job):
    """Forget ``job`` and end it. Raises RuntimeError if a process survived."""
    with _lock:
        if _jobs.get(_key(job)) is job:
            del _jobs[_key(job)]
        _cancel_timer(job)
        _last_used.pop(job.id, None)
    job.end()


def jobs():
    """This kernel's warm jobs."""
    with _lock:
        return list(_jobs.values())


def current_job_ids():
    """The environment markers of this kernel's warm jobs."""
    return {job.id for job in jobs()}


def shutdown():
    """End this kernel's warm jobs (``course_lib.shutdown()``). Raises RuntimeError,
    after trying them all, if a process survived."""
    problems = []
    for job in jobs():
        try:
            discard(job)
        except RuntimeError as exc:
            problems.append(str(exc))
    if problems:
        raise RuntimeError("; ".join(problems))


def _arm_timer(job):
    timer = _timers[job.id] = threading.Timer(job.idle_s, _expire, args=(job,))
    timer.daemon = True
    timer.start()


def _cancel_timer(job):
    timer = _timers.pop(job.id, None) if job is not None else None
    if timer is not None:
        timer.cancel()


def _expire(job):
    with _lock:
        if (_jobs.get(_key(job)) is job
                and time.monotonic() - _last_used[job.id] >= job.idle_s - 1):
            discard(job)


atexit.register(shutdown)
