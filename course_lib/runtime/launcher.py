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
import sys
import time
from pathlib import Path

import cloudpickle

from course_lib.runtime import nccl_rules, pickling, warm
from course_lib.runtime.backend import resolve_backend
from course_lib.runtime.failures import (LaunchError, LaunchTimeout, errors_of, failure, gave_up,
                                        timeout_error)
from course_lib.runtime.hangs import diagnose_hang
from course_lib.runtime.job import Job
from course_lib.runtime.shipped import Shipped

__all__ = ["run", "run_script", "run_cell", "shutdown", "Results", "LaunchError",
           "LaunchTimeout"]


class Results(list):
    """Per-rank return values (``results[r]`` came from rank r), plus the job's
    merged :class:`~course_lib.trace.Trace` as ``.trace``, its ``.backend``, its
    rendezvous ``.port``, ``.wall_time`` in seconds (launch to exit, as the
    notebook saw it) and ``.restarts``, how many times torchrun restarted the ranks
    before they returned (0 unless the call gave ``max_restarts``)."""

    restarts = 0
    trace = None
    port = None
    backend = None
    wall_time = None


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
    job = Job(nproc, backend, {"mode": "script", "timeout": timeout,
                               "nccl_rules": nccl_rules.requested()}, max_restarts=max_restarts)
    (job.dir / "payload.json").write_text(
        json.dumps({"path": str(path), "argv": [str(a) for a in script_args]}))
    saved = _finish(job, started, timeout)
    results = Results([None] * nproc)
    results.port, results.backend, results.restarts = saved["port"], backend, saved["restarts"]
    results.wall_time = time.perf_counter() - started
    return results


def _run_restartable(payload, nproc, backend, timeout, max_restarts, rules, shipped):
    """:func:`run` with ``max_restarts``: one function in a torchrun job of its own."""
    backend = resolve_backend(backend, nproc)
    rules = nccl_rules.requested() if rules is None else bool(rules)
    started = time.perf_counter()
    job = Job(nproc, backend, {"mode": "once", "timeout": timeout, "nccl_rules": rules},
              max_restarts=max_restarts)
    (job.dir / "task1.pkl").write_bytes(payload)
    saved = _finish(job, started, timeout, shipped)
    missing = [r for r in range(nproc) if f"result{r}-1.pkl" not in saved]
    if missing:
        raise LaunchError(f"ranks {missing} ended without returning from the function (did it "
                          f"end its process, e.g. sys.exit()?)", ranks=missing)
    results = _results(lambda name: saved[name], nproc, 1)
    results.port, results.backend, results.restarts = saved["port"], backend, saved["restarts"]
    results.wall_time = time.perf_counter() - started
    return results


def _finish(job, started, timeout, shipped=None):
    """Wait for a job that runs to its end (a script, a restartable call), raise what
    failed; the job is ended and its folder removed either way, results read first."""
    nproc, saved = job.nproc, {}
    try:
        outcome = job.pump(started + timeout)
        port = job.port
        if outcome == "timeout":
            error = timeout_error(timeout, nproc, job.stacks(), job.log,
                                   shipped() if shipped else None)
        else:
            error = errors_of(job, nproc) if job.proc.returncode else None
            if error is None and job.proc.returncode:
                error = failure([], job.log, gave_up(job))
            if error is not None and job.max_restarts:
                error.add_note(f"(torchrun restarted the ranks {job.max_restarts} times, "
                               "max_restarts; this is how the last attempt failed)")
        if error is None:  # read before the folder goes with the job
            saved = {p.name: p.read_bytes() for p in job.dir.glob("result*-1.pkl")}
            restarts = job.dir / "restarts"
            saved["restarts"] = int(restarts.read_text()) if restarts.exists() else 0
            saved["port"] = port
    except KeyboardInterrupt as exc:  # the student stopped it: say where each rank was
        _interrupted(job, shipped, job.kill, exc)
        raise
    except BaseException as exc:  # a bug of ours
        _end(job.kill, exc)
        raise
    _end(job.kill, error)
    if error is not None:
        error.port = port
        raise error
    return saved


def shutdown():
    """End this kernel's warm job (it also ends at exit, with the kernel, and
    after ``COURSE_LIB_WARM_IDLE_S`` seconds without a call)."""
    warm.shutdown()


def _check(nproc, timeout):
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _call(mode, payload, nproc, backend, timeout, fresh, shipped, rules=None):
    backend = resolve_backend(backend, nproc)
    rules = nccl_rules.requested() if rules is None else bool(rules)
    started = time.perf_counter()
    serving = warm.acquire(nproc, backend, timeout, fresh=fresh, rules=rules)
    job = serving.job
    done, error = set(), None
    try:
        number = serving.send(mode, payload)

        def on_marker(kind, task, rank):
            if task == number:
                done.add(rank)
                if kind == "retire":  # the call ended the default group: no more calls
                    serving.retired = True
            return len(done) == nproc

        outcome = job.pump(started + timeout, on_marker)
        port = job.port
        if outcome == "done":
            results = _results(lambda name: (job.dir / name).read_bytes(), nproc, number)
        elif outcome == "timeout":
            error = timeout_error(timeout, nproc, job.stacks(), job.log, shipped())
        else:
            error = errors_of(job, nproc, number) or failure(
                [], job.log, f"torchrun exited with status {job.proc.returncode} before "
                "every rank returned (did the call end its process, e.g. sys.exit()?)")
    except KeyboardInterrupt as exc:  # the student stopped it: say where each rank was
        _interrupted(job, shipped, lambda: warm.discard(serving), exc)
        raise
    except BaseException as exc:  # a bug of ours: nothing is reused
        _end(lambda: warm.discard(serving), exc)
        raise
    if error is None:
        warm.release(serving)
    else:  # a failed rank may have left the others inside a collective: end them all
        _end(lambda: warm.discard(serving), error)
    if error is not None:
        error.port = port
        raise error
    results.port, results.backend = port, backend
    results.wall_time = time.perf_counter() - started
    return results


def _interrupted(job, shipped, kill, interrupt):
    """After an interrupt (the kernel's stop button, Ctrl-C): print where each live rank
    was, as a timeout would (a job that never ends is the usual reason to stop it), then
    end the job. The interrupt is what propagates; a failure here becomes its note."""
    try:
        diagnosis = diagnose_hang(job.stacks(), job.nproc, shipped() if shipped else Shipped())
        print(f"Interrupted: the job was stopped.\n{diagnosis.explain()}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - the interrupt still wins
        interrupt.add_note(f"(while reading the ranks' stacks, another error: {exc!r})")
    finally:
        _end(kill, interrupt)


def _end(kill, error):
    """Run the clean-up ``kill``; if it fails too, the original error (a rank's
    failure, a timeout, an interrupt) still wins: the clean-up's failure is
    attached to it as a note."""
    try:
        kill()
    except Exception as exc:  # noqa: BLE001
        if error is None:
            raise
        error.add_note(f"(while cleaning up after this, another error: {exc!r})")


def _results(read, nproc, number):
    """The ranks' values of call ``number``; ``read(file name)`` gives a file's bytes."""
    results, exports = Results(), []
    for rank in range(nproc):
        value, trace_export = cloudpickle.loads(read(f"result{rank}-{number}.pkl"))
        results.append(value)
        if trace_export is not None:
            exports.append(trace_export)
    if exports:
        from course_lib.trace import Trace

        results.trace = Trace.from_exports(exports)
    return results


