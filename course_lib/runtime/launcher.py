"""Run a function, a cell or a script on N ranks of a real ``torchrun`` job.

The notebook is never a rank. :func:`run` ships the function by value
(cloudpickle) to a temporary job folder, starts
``python -m torch.distributed.run ... -m course_lib.runtime.worker JOB`` as a child
process, streams every rank's output into the cell prefixed with ``[rankR]``,
and returns the per-rank return values::

    def hello():
        return dist.get_rank() * 10
    run(hello, nproc=3)            # -> [0, 10, 20]

Under NCCL each rank's default device is its GPU (``torch.set_default_device``),
so tensors a notebook function creates land on the rank's GPU.

Failures are loud and bounded: a rank that raises gives :class:`LaunchError`
with that rank's traceback; a job still running at ``timeout`` gives
:class:`LaunchTimeout` with the Python stack of every rank still alive.
Whatever happens (including a kernel interrupt) every process of the job is
killed and waited for before the call returns.
"""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import cloudpickle

from course_lib.runtime import procs
from course_lib.runtime.backend import resolve_backend

__all__ = ["run", "run_script", "run_cell", "Results", "LaunchError", "LaunchTimeout"]

_RANK_LINE = re.compile(r"^\[rank(\d+)\]")
# Spare time after `timeout` to collect stacks and kill: bounded too.
_STACK_GRACE_S = 3.0


class LaunchError(RuntimeError):
    """A rank failed. ``.ranks`` lists the failed ranks, ``.errors`` their records
    (rank, type, message, traceback) in the order they failed; ``.port`` is the
    job's rendezvous port (free again by the time you see this)."""

    port = None

    def __init__(self, message, ranks=(), errors=(), log=""):
        super().__init__(message)
        self.ranks = list(ranks)
        self.errors = list(errors)
        self.log = log

    @property
    def exc_type(self):
        """Exception class name of the first rank that failed, or None."""
        return self.errors[0]["type"] if self.errors else None


class LaunchTimeout(LaunchError):
    """The job outlived its timeout. ``.stacks`` maps rank -> Python stack dump."""

    def __init__(self, message, ranks=(), stacks=None, log=""):
        super().__init__(message, ranks=ranks, log=log)
        self.stacks = dict(stacks or {})


class Results(list):
    """Per-rank return values (``results[r]`` came from rank r), plus the job's
    merged :class:`~course_lib.trace.Trace` as ``.trace``, its ``.backend``, its
    rendezvous ``.port`` and ``.wall_time`` in seconds (launch to exit, as the
    notebook saw it)."""

    trace = None
    port = None
    backend = None
    wall_time = None


def run(fn, *args, nproc=2, backend="auto", timeout=120.0, **kwargs):
    """Run ``fn(*args, **kwargs)`` on every rank, inside an initialised default
    process group, and return the list of per-rank results (a :class:`Results`)."""
    payload = cloudpickle.dumps((fn, args, kwargs))
    return _launch("fn", payload, nproc=nproc, backend=backend, timeout=timeout)


def run_cell(source, namespace=None, *, nproc=2, backend="auto", timeout=120.0):
    """Execute ``source`` as an SPMD program on every rank (what ``%%torchrun`` does).
    ``namespace`` holds names the cell may use (shipped by value). The cell sees
    ``rank``, ``world_size``, ``local_rank`` and ``device`` as well."""
    payload = cloudpickle.dumps((source, dict(namespace or {})))
    return _launch("cell", payload, nproc=nproc, backend=backend, timeout=timeout)


def run_script(path, *script_args, nproc=2, backend="auto", timeout=600.0):
    """Run a plain ``.py`` file on every rank (``sys.argv = [path, *script_args]``),
    as ``torchrun`` would. The script initialises its own process group (e.g. with
    :func:`course_lib.runtime.backend.init_distributed`); ``COURSE_BACKEND`` tells it which
    backend was resolved. Returns a :class:`Results` of ``None`` per rank."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such script: {path}")
    payload = json.dumps({"path": str(path), "argv": [str(a) for a in script_args]}).encode()
    return _launch("script", payload, nproc=nproc, backend=backend, timeout=timeout)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(job_id, backend, nproc):
    env = dict(os.environ)
    env[procs.MARKER] = job_id
    env["COURSE_BACKEND"] = backend
    env["PYTHONUNBUFFERED"] = "1"
    # torchrun would set 1 and print a warning; share the cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # Ranks must import what the notebook imports: course_lib and the notebook's folder.
    roots = [str(Path(__file__).resolve().parents[2]), os.getcwd()]
    if env.get("PYTHONPATH"):
        roots.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(roots)
    return env


def _command(job_dir, nproc, port):
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        "--max-restarts=0", "--monitor-interval=0.1",
        "-m", "course_lib.runtime.worker", str(job_dir),
    ]


def _launch(mode, payload, *, nproc, backend, timeout):
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    backend = resolve_backend(backend, nproc)
    job_id = uuid.uuid4().hex
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="course-job-") as tmp:
        job_dir = Path(tmp)
        (job_dir / "payload.pkl").write_bytes(payload)
        spec = {"mode": mode, "backend": backend, "nproc": nproc,
                "launcher_pid": os.getpid(), "timeout": timeout}
        (job_dir / "spec.json").write_text(json.dumps(spec))
        port = _free_port()
        proc = subprocess.Popen(
            _command(job_dir, nproc, port), env=_worker_env(job_id, backend, nproc),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=procs.die_with_parent, text=True, bufsize=1,
            errors="replace",
        )
        log, stacks = [], None
        try:
            if _pump_output(proc, started + timeout, log):
                stacks = _collect_stacks(job_dir, nproc, job_id)
            else:
                proc.wait()
        finally:
            # Runs on success, failure, timeout and KeyboardInterrupt alike.
            procs.kill_job(proc, job_id)
        try:
            if stacks is not None:
                raise _timeout_error(timeout, nproc, stacks, log)
            results = _collect(job_dir, nproc, proc.returncode, log)
        except LaunchError as exc:
            exc.port = port
            raise
    results.port = port
    results.backend = backend
    results.wall_time = time.perf_counter() - started
    return results


def _pump_output(proc, deadline, log):
    """Print rank lines as they arrive; keep torchrun's own lines in ``log``.
    Returns True if the deadline passed before the job closed its output."""
    lines = queue.Queue()

    def reader():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    while True:
        if time.perf_counter() > deadline:
            return True
        try:
            line = lines.get(timeout=0.05)
        except queue.Empty:
            continue
        if line is None:
            return False
        if _RANK_LINE.match(line):
            print(line, end="", flush=True)
        else:
            log.append(line)


def _collect_stacks(job_dir, nproc, job_id):
    """Ask every live rank for its Python stack (faulthandler on SIGUSR1)."""
    for pid in procs.rank_pids(job_dir, job_id):
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    stacks, deadline = {}, time.perf_counter() + _STACK_GRACE_S
    while time.perf_counter() < deadline and len(stacks) < nproc:
        time.sleep(0.1)
        for rank in range(nproc):
            path = job_dir / f"stack{rank}.txt"
            if rank not in stacks and path.exists() and path.stat().st_size:
                time.sleep(0.05)  # let faulthandler finish the dump
                stacks[rank] = path.read_text(errors="replace")
    return stacks


def _timeout_error(timeout, nproc, stacks, log):
    parts = [f"the job did not finish within timeout={timeout:g}s and was stopped. "
             "A common cause is a deadlock: a send or recv (or a collective) that no "
             "other rank matches. Stack of every rank still running:"]
    for rank in sorted(stacks):
        parts.append(f"\n--- rank {rank} ---\n{_trim_stack(stacks[rank])}")
    missing = [r for r in range(nproc) if r not in stacks]
    if missing:
        parts.append(f"\n(no stack from ranks {missing}: they had exited or were not started)")
    return LaunchTimeout("".join(parts), ranks=sorted(stacks), stacks=stacks, log="".join(log))


def _trim_stack(text):
    """faulthandler's dump without idle helper threads and launcher frames."""
    blocks, keep = text.strip().split("\n\n"), []
    for block in blocks:
        lines = block.splitlines()
        frames = [ln for ln in lines[1:] if ln.strip().startswith("File")]
        if frames and all(any(idle in ln for idle in ("threading.py", "runtime/worker.py",
                                                      "concurrent/futures/thread.py"))
                          for ln in frames):
            continue  # a helper thread waiting, nothing of the student's
        keep.append("\n".join(ln for ln in lines if "runtime/worker.py" not in ln
                              and "<frozen runpy>" not in ln))
    return "\n\n".join(keep)


def _collect(job_dir, nproc, returncode, log):
    errors = []
    for rank in range(nproc):
        path = job_dir / f"error{rank}.json"
        if path.exists():
            errors.append(json.loads(path.read_text()))
    if errors or returncode != 0:
        raise _failure(errors, returncode, log)
    results = Results()
    exports = []
    for rank in range(nproc):
        path = job_dir / f"result{rank}.pkl"
        if not path.exists():
            raise _failure([], returncode, log, f"rank {rank} exited without a result")
        value, trace_export = cloudpickle.loads(path.read_bytes())
        results.append(value)
        if trace_export is not None:
            exports.append(trace_export)
    if exports:
        from course_lib.trace import Trace
        results.trace = Trace.from_exports(exports)
    return results


def _failure(errors, returncode, log, reason=None):
    errors = sorted(errors, key=lambda e: e["time"])
    if errors:
        first = errors[0]
        others = [e["rank"] for e in errors[1:]]
        msg = (f"rank {first['rank']} failed with {first['type']}: {first['message']}\n"
               f"\nTraceback of rank {first['rank']}:\n{first['traceback']}")
        if others:
            msg += f"\n(ranks {others} failed after it, probably as a consequence)"
        return LaunchError(msg, ranks=sorted(e["rank"] for e in errors), errors=errors,
                           log="".join(log))
    tail = "".join(log[-40:])
    reason = reason or f"torchrun exited with status {returncode} and no rank reported an error"
    return LaunchError(f"{reason}. Launcher output:\n{tail}", log="".join(log))
