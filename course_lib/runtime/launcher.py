"""Run a function, a cell or a script on N ranks of a real ``torchrun`` job.

The notebook is never a rank. :func:`run` ships the function by value
(cloudpickle) to the ranks of a torchrun job, streams every rank's output into
the cell prefixed with ``[rankR]``, and returns the per-rank return values::

    def hello():
        return dist.get_rank() * 10
    run(hello, nproc=3)            # -> [0, 10, 20]

The job stays up between calls (warm ranks, :mod:`course_lib.runtime.warm`):
the first call of a kernel pays for starting torchrun, later calls with the
same ``nproc`` and backend return in a fraction of a second, each starting
from the state a fresh job would have. Under NCCL each rank's default device
is its GPU, so tensors a notebook function creates land on the rank's GPU.

Failures are loud and bounded: a rank that raises gives :class:`LaunchError`
with that rank's traceback (with ``max_restarts=N``, torchrun first starts every rank
afresh up to N times: how a training job survives a dead rank, Lab 08); a call still running at ``timeout`` gives
:class:`LaunchTimeout` with the Python stack of every rank still alive. After
either, and after a kernel interrupt, every process of the job is killed and
waited for before the call returns; the next call starts a fresh job.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from course_lib.runtime import nccl_rules, pickling, warm
from course_lib.runtime.backend import resolve_backend
from course_lib.runtime.failures import LaunchError, LaunchTimeout
from course_lib.runtime.job import Job
from course_lib.runtime.results import Results
from course_lib.runtime.shipped import Shipped

__all__ = ["run", "run_script", "run_cell", "shutdown", "Results", "LaunchError",
           "LaunchTimeout"]


def run(fn, *args, nproc=2, backend="auto", timeout=120.0, fresh=False, nccl_rules=None,
        max_restarts=0, **kwargs):
    """Run ``fn(*args, **kwargs)`` on every rank, inside an initialised default
    process group, and return the list of per-rank results (a :class:`Results`).
    ``fresh=True`` starts a brand-new job instead of reusing the warm one;
    ``nccl_rules=True`` makes a gloo job refuse what NCCL would
    (:mod:`course_lib.runtime.nccl_rules`; None: ``COURSE_LIB_NCCL_RULES`` decides).

    ``max_restarts=N``: torchrun's ``--max-restarts``, in a job of its own (never the
    warm one). A rank that raises or is killed (SIGKILL too) ends every rank, and
    torchrun starts them all again, fresh processes calling ``fn`` from the top with
    ``TORCHELASTIC_RESTART_COUNT`` one higher; after N restarts the usual
    :class:`LaunchError`. ``timeout`` bounds all the attempts together. What survives
    a restart is what ``fn`` saved (a checkpoint), as on a cluster::

        def train():
            resume_from_latest_checkpoint_or_start()   # attempt 0 finds none
            ...
        run(train, nproc=4, max_restarts=2).restarts    # -> 1 if one rank died once
    """
    _check(nproc, timeout)
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a non-negative integer, got {max_restarts!r}")
    payload = pickling.dumps((fn, args, kwargs))
    if max_restarts:
        return _run_restartable(payload, nproc, backend, timeout, max_restarts, nccl_rules,
                                lambda: Shipped((fn, args, kwargs)))
    return _call("fn", payload, nproc, backend, timeout, fresh,
                 lambda: Shipped((fn, args, kwargs)), nccl_rules)


def run_cell(source, namespace=None, *, nproc=2, backend="auto", timeout=120.0, fresh=False,
             nccl_rules=None):
    """Execute ``source`` as an SPMD program on every rank (what ``%%torchrun`` does).
    ``namespace`` holds names the cell may use (shipped by value). The cell sees
    ``rank``, ``world_size``, ``local_rank`` and ``device`` as well."""
    _check(nproc, timeout)
    payload = pickling.dumps((source, dict(namespace or {})))
    return _call("cell", payload, nproc, backend, timeout, fresh,
                 lambda: Shipped(list((namespace or {}).values()), cell=source), nccl_rules)


def run_script(path, *script_args, nproc=2, backend="auto", timeout=600.0, max_restarts=0):
    """Run a plain ``.py`` file on every rank (``sys.argv = [path, *script_args]``),
    as ``torchrun`` would, in a fresh job (a script owns its process group: it
    initialises it, e.g. with :func:`course_lib.runtime.backend.init_distributed`;
    ``COURSE_BACKEND`` tells it which backend was resolved). ``max_restarts`` is
    torchrun's, as in :func:`run`; in a job that restarts, each attempt's rank 0 hosts
    the process group's store, so a script ends with a collective (a barrier) rather
    than leaving its peers to find rank 0 gone. Returns a :class:`Results` of ``None``
    per rank."""
    _check(nproc, timeout)
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such script: {path}")
    backend = resolve_backend(backend, nproc)
    started = time.perf_counter()
    script = json.dumps({"path": str(path), "argv": [str(a) for a in script_args]})
    job = Job(nproc, backend, "script", timeout, nccl_rules.requested(), max_restarts,
              files={"payload.json": script.encode()})
    results = job.wait(timeout, since=started)
    results.wall_time = time.perf_counter() - started
    return results


def _run_restartable(payload, nproc, backend, timeout, max_restarts, rules, shipped):
    """:func:`run` with ``max_restarts``: one function in a torchrun job of its own."""
    backend = resolve_backend(backend, nproc)
    rules = nccl_rules.requested() if rules is None else bool(rules)
    started = time.perf_counter()
    job = Job(nproc, backend, "once", timeout, rules, max_restarts, files={"task1.pkl": payload})
    results = job.wait(timeout, shipped, since=started)
    results.wall_time = time.perf_counter() - started
    return results


def _call(mode, payload, nproc, backend, timeout, fresh, shipped, rules=None):
    """One call on the warm job for (nproc, backend, rules): the pool hands it out, the job
    runs the call (and ends itself if the call fails), the pool takes it back."""
    backend = resolve_backend(backend, nproc)
    rules = nccl_rules.requested() if rules is None else bool(rules)
    started = time.perf_counter()
    job = warm.acquire(nproc, backend, timeout, fresh=fresh, rules=rules)
    try:
        results = job.call(mode, payload, timeout, shipped, since=started)
    finally:
        warm.release(job)
    results.wall_time = time.perf_counter() - started
    return results


def shutdown():
    """End this kernel's warm job (it also ends at exit, with the kernel, and
    after ``COURSE_LIB_WARM_IDLE_S`` seconds without a call)."""
    warm.shutdown()


def _check(nproc, timeout):
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
