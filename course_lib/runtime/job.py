"""One torchrun process and its ranks, seen from the notebook: start, output, stacks, end.

A :class:`Job` owns a temporary folder (the payloads, results, error records,
stack dumps and torchrun's own temporary files) and the ``torchrun`` child. It
reads the child's output on a thread for the job's whole life, so that a call
can print its ranks' lines as they arrive and stop at a marker line, at the
child's exit, or at a deadline, whichever comes first.

How a job can never outlive the notebook kernel, with no ``preexec_fn`` (not
safe in a threaded kernel, and ``PR_SET_PDEATHSIG`` fires when the *thread*
that started the child ends, which would kill a warm job started from a
helper thread): every rank watches the kernel's pid and exits when it is
gone, and torchrun exits when its ranks fail (at once with ``--max-restarts=0``,
the default; after ``max_restarts`` fresh starts of every rank otherwise).
"""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from course_lib.runtime import nccl_rules, procs

AGENT = Path(__file__).resolve().with_name("agent.py")
RANK_LINE = re.compile(r"^\[rank(\d+)\]")
# kind, task, rank. Found anywhere in a line: C++ code in a rank (a profiler, glog) writes
# to the same pipe without Python's buffering, and a partial line of its own can come
# first; the marker itself is one write, so nothing lands inside it.
MARKER_LINE = re.compile(r"\x1fcourse_lib (\w+) (\d+) (\d+)$")
# Spare time after a deadline to collect stacks: bounded too.
STACK_GRACE_S = 3.0
# After torchrun exits, lines still in the pipe are read for at most this long
# (a grandchild a rank left behind may hold the pipe open for ever).
DRAIN_S = 0.5


def marker(kind, task, rank):
    """The line a rank writes (raw, unprefixed) to tell the notebook where it is."""
    return f"\x1fcourse_lib {kind} {task} {rank}\n"


class Job:
    """``python -m torch.distributed.run ... -m course_lib.runtime.worker DIR`` on
    ``nproc`` ranks of one node. ``spec`` is what the ranks read at start-up."""

    def __init__(self, nproc, backend, spec, extra_env=None, max_restarts=0):
        self.nproc, self.backend, self.id = nproc, backend, uuid.uuid4().hex
        self.max_restarts = max_restarts
        procs.sweep_folders()  # what killed kernels left
        self.dir = Path(tempfile.mkdtemp(prefix="course-job-"))
        (self.dir / "spec.json").write_text(json.dumps({**spec, "backend": backend,
                                                         "nproc": nproc,
                                                         "launcher_pid": os.getpid()}))
        self.log = []  # torchrun's own lines (not a rank's): shown when something fails
        self._lines = queue.Queue()
        self.proc = subprocess.Popen(
            self._command(spec), env=self._env(extra_env or {}, spec.get("nccl_rules", False)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            text=True, bufsize=1, errors="replace")
        threading.Thread(target=self._read, name=f"course-job-{self.id[:8]}", daemon=True).start()

    def _command(self, spec):
        # --standalone: the rendezvous store binds port 0 and learns its port from
        # the kernel, so two notebooks launching at the same moment never collide.
        options = [f"--nproc-per-node={self.nproc}", f"--max-restarts={self.max_restarts}",
                   "--monitor-interval=0.1"]
        if spec["mode"] != "script" and self.backend == "gloo" and not spec.get("nccl_rules"):
            # torchrun with the ranks forked from it (torch imported once): agent.py
            return [sys.executable, str(AGENT), *options, str(self.dir)]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", *options,
                "-m", "course_lib.runtime.worker", str(self.dir)]

    def _env(self, extra, rules=False):
        env = dict(os.environ)
        env.pop(nccl_rules.ENV, None)
        if rules:  # course_lib.runtime.nccl_rules
            env[nccl_rules.ENV] = "1"
        env[procs.MARKER] = self.id
        env["COURSE_BACKEND"] = self.backend
        if self.backend == "gloo":
            # gloo ranks compute on the CPU (backend.current_device). Hiding the GPUs keeps
            # torch's own defaults from reaching for one the job does not own (an optimizer's
            # graph-capture check, Lightning's "auto"): on a one-GPU laptop every rank would
            # otherwise open a CUDA context of its own on the shared GPU.
            env["CUDA_VISIBLE_DEVICES"] = ""
        env["PYTHONUNBUFFERED"] = "1"
        # torchrun's and the ranks' temporary files live and die with the job folder
        env["TMPDIR"] = str(self.dir)
        # torchrun would set 1 and print a warning; share the cores instead.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.nproc)))
        # Ranks must import what the notebook imports: course_lib and the notebook's folder.
        roots = [str(Path(__file__).resolve().parents[2]), os.getcwd()]
        if env.get("PYTHONPATH"):
            roots.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(roots)
        if self.max_restarts:
            # A restarted rank would otherwise meet the previous attempt's keys in the store
            # torchrun's rendezvous shares with init_process_group, and dial a dead peer's
            # port (gloo: "connectFullMesh failed ... Connection refused"; pytorch#135712):
            # with sharing off, every attempt's rank 0 hosts a store of its own.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env.update(extra)
        return env

    def _read(self):
        try:
            for line in self.proc.stdout:
                self._lines.put(line)
        except (OSError, ValueError):  # the pipe was closed under us by kill()
            pass
        self._lines.put(None)

    @property
    def port(self):
        """The rendezvous port torchrun's store bound (reported by rank 0), or None."""
        try:
            return int((self.dir / "port").read_text())
        except (OSError, ValueError):
            return None

    def alive(self):
        return self.proc.poll() is None

    def pump(self, deadline, on_marker=None):
        """Print rank lines as they arrive, keep torchrun's in ``self.log``, hand
        marker lines to ``on_marker(kind, task, rank)`` (which returns True when
        the call is complete). Returns "done", "exited" or "timeout"."""
        exited_at = None
        while True:
            now = time.perf_counter()
            if exited_at is None and self.proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > DRAIN_S:
                return "exited"
            if now > deadline:
                return "timeout"
            try:
                line = self._lines.get(timeout=0.02)
            except queue.Empty:
                continue
            if line is None:  # end of output: the job has exited or is about to
                self.proc.wait()
                return "exited"
            found = MARKER_LINE.search(line.rstrip("\n"))
            if found:
                if found.start():  # what another writer had begun on the same line
                    self.log.append(line[:found.start()] + "\n")
                kind, task, rank = found.group(1), int(found.group(2)), int(found.group(3))
                if on_marker is not None and on_marker(kind, task, rank):
                    return "done"
            elif RANK_LINE.match(line):
                print(line, end="", flush=True)
            else:
                self.log.append(line)

    def stacks(self):
        """Every live rank's Python stack, asked for with SIGUSR1 (faulthandler)."""
        for rank in range(self.nproc):
            path = self.dir / f"stack{rank}.txt"
            if path.exists():
                os.truncate(path, 0)  # ranks append: only this dump will be read
        for pid in procs.rank_pids(self.dir, self.id):
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

    def kill(self):
        """End torchrun, every rank and anything they started; remove the folder.
        Raises RuntimeError if a process survived SIGKILL."""
        try:
            procs.kill_job(self.proc, self.id)
        finally:
            procs.remove_folder(self.dir)
