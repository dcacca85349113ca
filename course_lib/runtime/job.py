"""A torchrun job's whole life, seen from the notebook: start, call, fail, end.

A :class:`Job` is one ``torchrun`` child and a temporary folder (payloads, results,
error records, stack dumps, torchrun's temporary files). **Start**: the folder and its
``spec.json``, the command line (:mod:`~course_lib.runtime.command`), the child, a
thread reading its output (:mod:`~course_lib.runtime.output`), and for a serving job
the store its calls go through. **Call** (:meth:`Job.call`, many times on warm ranks)
or **wait** (:meth:`Job.wait`, a script or a restartable call). **Fail**: read what the
ranks left (records, SIGTERM marks, torchrun's summary, a hung job's stacks) and have
it explained (:mod:`~course_lib.runtime.failures`); a failed, timed-out or interrupted
job ends itself before the error propagates. **End** (:meth:`Job.end`): every process
of the job, waited for, and the folder.

A job never outlives the notebook kernel, with no ``preexec_fn`` (not safe in a
threaded kernel, and ``PR_SET_PDEATHSIG`` fires when the *thread* that started the
child ends, which would kill a warm job started from a helper thread): every rank
watches the kernel's pid and exits when it is gone, and torchrun exits when its ranks
fail (at once, or after ``max_restarts`` fresh starts of every rank).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from course_lib.runtime import folders, procs
from course_lib.runtime.command import command, environment
from course_lib.runtime.failures import (LaunchError, explain, failure, gave_up, interrupted,
                                         timeout_error)
from course_lib.runtime.output import Output
from course_lib.runtime.results import Results, read_results

# Spare time after a deadline to collect stacks: bounded too.
STACK_GRACE_S = 3.0


class Job:
    """:mod:`course_lib.runtime.worker` on ``nproc`` ranks of one node, started by torchrun
    (for gloo calls, by :mod:`~course_lib.runtime.agent`, which forks them). ``mode``:
    ``serve`` (warm ranks, :meth:`call` after call), ``once`` (one function, ``files=
    {"task1.pkl": payload}``) or ``script`` (``files={"payload.json": ...}``); ``files``
    are written before any rank starts; serving ranks wait ``idle_s`` for a call."""

    def __init__(self, nproc, backend, mode, timeout, rules=False, max_restarts=0, files=None,
                 idle_s=600.0):
        self.nproc, self.backend, self.mode = nproc, backend, mode
        self.rules, self.max_restarts, self.idle_s = bool(rules), max_restarts, idle_s
        self.id, self.calls = uuid.uuid4().hex, 0
        self.retired = False  # a call ended the default group: the ranks serve no more
        self.ended, self._ending = False, threading.Lock()
        self.store = self.proc = None
        folders.sweep_folders()  # what killed kernels left
        self.dir = Path(tempfile.mkdtemp(prefix="course-job-"))
        spec = {"mode": mode, "timeout": float(timeout), "nccl_rules": self.rules,
                "backend": backend, "nproc": nproc, "launcher_pid": os.getpid()}
        if mode == "serve":
            spec.update(timeout=max(float(timeout), 3600.0), idle_s=idle_s)
        # first: a folder with its spec says whose it is, should the kernel die right now
        (self.dir / "spec.json").write_text(json.dumps(spec))
        extra = {}
        try:
            if mode == "serve":
                # port 0: the kernel picks a free port, no probe-then-bind race
                self.store = dist.TCPStore("127.0.0.1", 0, is_master=True,
                                           wait_for_workers=False, timeout=timedelta(seconds=30))
                extra["COURSE_LIB_STORE_PORT"] = str(self.store.port)
            for name, data in (files or {}).items():
                (self.dir / name).write_bytes(data)
            self.proc = subprocess.Popen(
                command(nproc, backend, mode, self.rules, max_restarts, self.dir),
                env=environment(nproc, backend, self.rules, max_restarts, self.id, self.dir,
                                extra),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, text=True, bufsize=1, errors="replace")
            self.output = Output(self.proc, f"course-job-{self.id[:8]}")
        except BaseException as exc:
            self._end_after(exc)
            raise

    @property
    def log(self):
        """torchrun's own lines so far (not the ranks'): shown when something fails."""
        return self.output.log

    @property
    def port(self):
        """The rendezvous port torchrun's store bound (reported by rank 0), or None."""
        try:
            return int((self.dir / "port").read_text())
        except (OSError, ValueError):
            return None

    def alive(self):
        return not self.ended and self.proc.poll() is None

    def reusable(self):
        """Can serve another call: serving, alive, and no call ended its group."""
        return self.mode == "serve" and not self.retired and self.alive()

    # ---- call ----------------------------------------------------------------------------

    def call(self, mode, payload, timeout, shipped, since=None):
        """Run one call (``mode`` ``fn`` or ``cell``, ``payload`` pickled) on the serving
        ranks and return their :class:`~course_lib.runtime.results.Results`; ``timeout``
        counts from ``since`` (a perf_counter time; default now). A failure, a timeout or
        an interrupt ends the job, then propagates. ``shipped()`` gives the
        :class:`~course_lib.runtime.shipped.Shipped` code a hang report quotes."""
        deadline = (time.perf_counter() if since is None else since) + timeout
        done, number, error, port = set(), None, None, None
        try:
            number = self._send(mode, payload)

            def on_marker(kind, task, rank):
                if task == number:
                    done.add(rank)
                    if kind == "retire":  # the call ended the default group
                        self.retired = True
                return len(done) == self.nproc

            outcome = self.output.pump(deadline, on_marker)
            port = self.port
            if outcome == "done":
                results = read_results(self.dir, self.nproc, number)
            elif outcome == "timeout":
                error = self._timeout(timeout, shipped)
            else:
                error = self._records_error(number) or failure(
                    [], self.log, f"torchrun exited with status {self.proc.returncode} before "
                    "every rank returned (did the call end its process, e.g. sys.exit()?)")
        except BaseException as exc:
            self._stopped(shipped, exc)
            raise
        if error is not None:  # a failed rank may have left the others inside a collective
            self._end_after(error)
            error.port = port
            raise error
        results.port, results.backend = port, self.backend
        return results

    def _send(self, mode, payload):
        """Hand call number ``self.calls`` to the ranks through the store."""
        self.calls += 1
        (self.dir / f"task{self.calls}.pkl").write_bytes(payload)
        task = {"id": self.calls, "mode": mode, "cwd": os.getcwd()}
        self.store.set(f"task/{self.calls}", json.dumps(task))
        return self.calls

    def wait(self, timeout, shipped=None, since=None):
        """Wait for a job that runs to its end (a script, a restartable call), end it, and
        return its :class:`~course_lib.runtime.results.Results` (``None`` per rank for a
        script), with ``.restarts``; raise what failed."""
        deadline = (time.perf_counter() if since is None else since) + timeout
        error, port = None, None
        try:
            outcome = self.output.pump(deadline)
            port = self.port
            if outcome == "timeout":
                error = self._timeout(timeout, shipped)
            elif self.proc.returncode:
                error = self._records_error(1) or failure(
                    [], self.log, gave_up(self.proc.returncode, self.max_restarts))
                if self.max_restarts:
                    error.add_note(f"(torchrun restarted the ranks {self.max_restarts} times, "
                                   "max_restarts; this is how the last attempt failed)")
            else:  # read before the folder goes with the job
                results, error = self._returned()
        except BaseException as exc:
            self._stopped(shipped, exc)
            raise
        self._end_after(error)
        if error is not None:
            error.port = port
            raise error
        results.port, results.backend = port, self.backend
        return results

    def _returned(self):
        """``(Results, None)`` of a job that ran to its end, or ``(None, LaunchError)`` when
        a rank of a function's job ended without returning from it."""
        if self.mode == "script":
            results = Results([None] * self.nproc)
        else:
            missing = [r for r in range(self.nproc)
                       if not (self.dir / f"result{r}-1.pkl").exists()]
            if missing:
                return None, LaunchError(
                    f"ranks {missing} ended without returning from the function (did it end "
                    f"its process, e.g. sys.exit()?)", ranks=missing)
            results = read_results(self.dir, self.nproc, 1)
        restarts = self.dir / "restarts"
        results.restarts = int(restarts.read_text()) if restarts.exists() else 0
        return results, None

    # ---- fail ----------------------------------------------------------------------------

    def _records_error(self, call):
        """The :class:`LaunchError` the ranks' records and marks tell for call ``call`` (1
        for a job that runs once), or None if no rank left one."""
        errors = []
        for rank in range(self.nproc):
            try:
                errors.append(json.loads((self.dir / f"error{rank}.json").read_text()))
            except (FileNotFoundError, ValueError):  # none, or cut short: its rank was ended
                continue  # while writing (the rank that failed first names the cause)
        # a job that restarts fails in its last attempt: an earlier attempt's record is history
        errors = [e for e in errors if e.get("attempt", 0) == self.max_restarts]
        recorded = {e["rank"] for e in errors}
        silent = [r for r in range(self.nproc)
                  if r not in recorded and self._ended_silently(r, call)]
        return explain(errors, silent, self.log)

    def _ended_silently(self, rank, call):
        """The rank left no record, no result of this call, and was not ended by torchrun
        (its SIGTERM mark, worker._mark_when_ended, is empty): it was killed or crashed."""
        try:
            return ((self.dir / f"ended{rank}.txt").stat().st_size == 0
                    and not (self.dir / f"result{rank}-{call}.pkl").exists())
        except FileNotFoundError:  # it never started (this attempt)
            return False

    def _timeout(self, timeout, shipped):
        return timeout_error(timeout, self.nproc, self.stacks(), self.log,
                             shipped() if shipped else None)

    def stacks(self):
        """Every live rank's Python stack, asked for with SIGUSR1 (faulthandler)."""
        for rank in range(self.nproc):
            path = self.dir / f"stack{rank}.txt"
            if path.exists():
                os.truncate(path, 0)  # ranks append: only this dump will be read
        for pid in procs.marked(folders.rank_pids(self.dir), self.id):
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        stacks, sizes, deadline = {}, {}, time.perf_counter() + STACK_GRACE_S
        while time.perf_counter() < deadline and len(stacks) < self.nproc:
            time.sleep(0.1)
            for rank in range(self.nproc):
                path = self.dir / f"stack{rank}.txt"
                size = path.stat().st_size if path.exists() else 0
                # faulthandler writes a thread at a time: a dump is whole once it
                # stops growing (read earlier, the student's frames may be missing)
                if rank not in stacks and size and sizes.get(rank) == size:
                    stacks[rank] = path.read_text(errors="replace")
                sizes[rank] = size
        return stacks

    def _stopped(self, shipped, exc):
        """A call or a wait stopped by ``exc`` before it could tell how the job ended: the
        student's interrupt (say where each rank was first) or a bug of ours. Either way
        the job ends, and nothing of it is reused."""
        if isinstance(exc, KeyboardInterrupt):
            self._interrupted(shipped, exc)
        else:
            self._end_after(exc)

    def _interrupted(self, shipped, interrupt):
        """After an interrupt: print where each live rank was, then end the job. The
        interrupt is what propagates; a failure here becomes its note."""
        try:
            print(interrupted(self.stacks(), self.nproc, shipped() if shipped else None),
                  file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - the interrupt still wins
            interrupt.add_note(f"(while reading the ranks' stacks, another error: {exc!r})")
        finally:
            self._end_after(interrupt)

    # ---- end -----------------------------------------------------------------------------

    def end(self):
        """End torchrun, every rank and anything they started; remove the folder. Raises
        RuntimeError if a process survived SIGKILL. Whoever ends the job second (the pool's
        idle timer, ``shutdown()``, the call's own clean-up) waits for the first, then
        returns: an end is tried once."""
        with self._ending:
            if self.ended:
                return
            self.ended = True
            if self.store is not None:  # idle serving ranks leave on their own
                try:
                    self.store.set(f"task/{self.calls + 1}", json.dumps({"stop": True}))
                except Exception:  # noqa: BLE001 - the job is being ended anyway
                    pass
            try:
                if self.proc is not None:
                    procs.kill_job(self.proc, self.id)
            finally:
                folders.remove_folder(self.dir)
                self.store = None  # the last reference: closes the server socket

    def _end_after(self, error):
        """:meth:`end`; if it fails too, ``error`` (a rank's failure, a timeout, an
        interrupt) still wins: the clean-up's failure becomes its note."""
        try:
            self.end()
        except Exception as exc:  # noqa: BLE001
            if error is None:
                raise
            error.add_note(f"(while cleaning up after this, another error: {exc!r})")
