"""Where a submission's code runs when the gradebook grades it: a bubblewrap sandbox.

:class:`Sandbox` starts :mod:`course_lib.submission.collector` (the student's side)
inside Debian's ``bwrap`` with:

- a filesystem of its own: the system's programs and libraries, Python, the
  virtual environment and ``course_lib`` itself, all read-only, except the grader:
  ``course_lib/grading/`` is not there, :mod:`course_lib.submission.grading` (a
  stand-in holding nothing of it) is mounted in its place; the rest of the course
  (solutions, tests, git history), the other submissions and the gradebook are not
  there at all; a private ``/tmp``; one writable folder, this notebook's output
  folder;
- new user, pid, network (loopback only: the ranks' gloo traffic), IPC and UTS
  namespaces, a new session, and death with the grader;
- limits on address space and file size (set by the collector before any student
  code runs); the judge bounds time.

Where ``bwrap`` is missing or cannot start (no user namespaces), the collector
runs as a plain process and :attr:`Sandbox.sandboxed` is False: the gradebook
flags every such row "unsandboxed". ``COURSE_LIB_SANDBOX=0`` asks for that on
purpose, ``=1`` makes a missing sandbox an error.

:meth:`Sandbox.ask` sends one message and waits, with a deadline, for its reply;
:meth:`Sandbox.interrupt` stops what the collector is doing (SIGINT);
:meth:`Sandbox.close` ends the collector and every process it started (found by
a marker in their environment, as the launcher finds ranks) and says what had to
be killed.
"""
from __future__ import annotations

import json
import os
import pickle
import select
import shutil
import tempfile
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import cloudpickle
import psutil

from course_lib.grading import hiding, shipping
from course_lib.grading.bwrap import bwrap_command, bwrap_works, sandbox_available  # noqa: F401
from course_lib.runtime import procs
from course_lib.submission.collector import HEADER, write_message

COLLECTOR = "course_lib.submission.collector"

RUN_MARKER = "COURSE_LIB_GRADING_RUN"
MAX_REPLY = 1 << 31
START_S = 120.0  # Python, torch and IPython importing on a busy machine


class SandboxError(RuntimeError):
    """The collector did not answer: ``.reason`` is "timeout" or "died"."""

    def __init__(self, message, reason):
        super().__init__(message)
        self.reason = reason


class Sandbox:
    """The collector of one submission, in its sandbox; ``workdir`` is its writable folder."""

    def __init__(self, workdir, full=False, extra_env=None, sandboxed=None, hide=()):
        """``hide``: the ids of the lab's items, whose library implementations (and
        torch counterparts) the sandbox holds only as stand-ins (:mod:`.hiding`)."""
        self.workdir = Path(workdir).resolve()
        self._hiding, self._hide = None, tuple(hide)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token = uuid.uuid4().hex
        self.sandboxed = sandbox_available() if sandboxed is None else sandboxed
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "MPLBACKEND": "module://matplotlib_inline.backend_inline" if full else "Agg",
            "COURSE_LIB_COLLECTOR_LOG": str(self.workdir / "collector.log"),
            "COURSE_LIB_COLLECTOR_FULL": "1" if full else "0", RUN_MARKER: self.token,
            # several notebooks' ranks share the cores: no thread pool per rank
            "OMP_NUM_THREADS": "1",
        }
        for name in ("COURSE_LIB_TEST_SESSION", "COURSE_LIB_SANDBOX_MEMORY_GB",
                     "COURSE_LIB_WARM_MAX", "COURSE_LIB_WARM_IDLE_S", "COURSE_LIB_NCCL_RULES"):
            if name in os.environ:
                env[name] = os.environ[name]
        env.update(extra_env or {})
        # the collector imports the course_lib this process imported, wherever it lies
        import course_lib

        env["PYTHONPATH"] = str(Path(course_lib.__file__).resolve().parents[1])
        if self.sandboxed:
            env.update(HOME="/tmp/home", TMPDIR="/tmp", MPLCONFIGDIR="/tmp/mpl",
                       IPYTHONDIR="/tmp/ipython", GLOO_SOCKET_IFNAME="lo")
            self._hiding = tempfile.mkdtemp(prefix="course-hidden-")
            mounts = hiding.overlays(hide, self._hiding) if hide else []
            command = bwrap_command(self.workdir, env, mounts) + [
                sys.executable, "-m", COLLECTOR]
            popen_env = None
        else:
            home = self.workdir / ".home"
            home.mkdir(exist_ok=True)
            env.update(HOME=str(home), IPYTHONDIR=str(home / "ipython"))
            command = [sys.executable, "-m", COLLECTOR]
            popen_env = {**os.environ, **env}
        self.stderr = open(self.workdir / "sandbox.err", "wb")
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, env=popen_env, cwd=self.workdir,
                                     start_new_session=True)
        self._out = self.proc.stdout.fileno()
        try:
            self._reply(time.monotonic() + START_S)
        except SandboxError:
            self.close()
            raise

    # ---- talking to the collector ---------------------------------------------------------
    def ask(self, message, timeout):
        """Send ``message`` (a dict) and return the collector's reply (a dict), or raise
        :class:`SandboxError` when it does not come within ``timeout`` seconds."""
        try:
            # cloudpickle: a test hands over functions of its own, by value; the library's
            # code that this lab's stand-ins hide travels by value too (.shipping)
            body = shipping.dumps(message, self._hide) if self._hiding and self._hide \
                else cloudpickle.dumps(message)
            write_message(self.proc.stdin.fileno(), body)
        except (BrokenPipeError, OSError):
            raise SandboxError("the submission's process has ended", "died") from None
        return self._reply(time.monotonic() + timeout)

    def wait_reply(self, timeout):
        """The reply to the message already sent (after :meth:`interrupt`)."""
        return self._reply(time.monotonic() + timeout)

    def _reply(self, deadline):
        header = self._read(HEADER.size, deadline)
        size = HEADER.unpack(header)[0]
        if size > MAX_REPLY:
            raise SandboxError(f"a reply of {size} bytes", "died")
        body = self._read(size, deadline)
        try:
            reply = json.loads(body)
        except ValueError:
            raise SandboxError("the submission's process answered something unreadable",
                               "died") from None
        if not isinstance(reply, dict):
            raise SandboxError("the submission's process answered something unreadable", "died")
        return reply

    def _read(self, size, deadline):
        chunks, left = [], size
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0:
                raise SandboxError("no answer in time", "timeout")
            ready, _, _ = select.select([self._out], [], [], min(wait, 1.0))
            if not ready:
                continue
            chunk = os.read(self._out, min(left, 1 << 20))
            if not chunk:
                raise SandboxError("the submission's process has ended", "died")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    # ---- stopping it ------------------------------------------------------------------------
    def interrupt(self):
        """SIGINT to the collector (a cell or request that outlives its time)."""
        for proc in self._processes():
            try:
                if COLLECTOR in " ".join(proc.cmdline()):
                    proc.send_signal(signal.SIGINT)
            except psutil.Error:
                continue

    def end_ranks(self):
        """End every process the collector started (its ranks, warm or not, and anything
        else), keeping the collector: nothing that ran there is there for the next
        request, whatever the collector's own code was made to do. Its next job starts
        anew (a warm job found dead is replaced). The collector is the first process of
        the sandbox whose parent is not one (a process the student's code started under
        the collector's name, or one orphaned to the sandbox's init, came later)."""
        found = sorted(self._processes(), key=_started)
        pids = {proc.pid for proc in found}
        tops = []
        for proc in found:
            try:
                if proc.ppid() not in pids:
                    tops.append(proc)
            except psutil.Error:
                continue
        ended = []
        for proc in found:
            try:
                if not tops or proc != tops[0]:
                    proc.kill()
                    ended.append(proc)
            except psutil.Error:
                continue
        procs.wait_dead(ended, 10)

    def _processes(self):
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(RUN_MARKER) == self.token:
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found

    def close(self, grace_s=10.0):
        """End the collector and everything it started; returns what had to be killed."""
        if self.proc.poll() is None:
            try:
                write_message(self.proc.stdin.fileno(), pickle.dumps({"op": "bye"}))
            except OSError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        killed = []
        deadline = time.monotonic() + 2.0
        left = self._processes()
        while left and time.monotonic() < deadline:  # ranks follow their launcher's exit
            time.sleep(0.1)
            left = self._processes()
        for proc in left:
            try:
                killed.append(f"pid {proc.pid} ({' '.join(proc.cmdline()[:3])[:80]})")
                proc.kill()
            except psutil.Error:
                continue
        if self.proc.poll() is None:
            self.proc.kill()
        procs.wait_dead(left, 10)
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.stderr):
            try:
                stream.close()
            except OSError:
                pass
        if self._hiding:
            shutil.rmtree(self._hiding, ignore_errors=True)
        return killed


def _started(proc):
    try:
        return proc.create_time(), proc.pid
    except psutil.Error:
        return float("inf"), proc.pid

