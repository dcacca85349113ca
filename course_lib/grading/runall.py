"""Execute every solution notebook with papermill (what ``make run`` does).

    python -m course_lib.grading.runall --quick [--out runs/DATE] [--nproc 2] [--only 00,01]
    python -m course_lib.grading.runall --quick --parallel 9   # side by side, a process each

Each notebook gets the parameters QUICK, NPROC, BACKEND and OUTPUT_DIR; it
saves its timelines (PNG) and Chrome traces (JSON) under OUTPUT_DIR, and the
executed notebook lands beside them, with ``summary.csv`` (notebook, status,
seconds, error). Exits 1 if any notebook failed.

One at a time (the default), every notebook runs in this process and its cells'
output streams here. With ``--parallel N`` (or ``--notebook-timeout``) each
notebook runs in a process of its own (this module again, ``--only NN
--result FILE``), at most N at once, its output in ``OUTPUT_DIR/logs/NN.log``;
a notebook that outlives ``--notebook-timeout`` is stopped with every process
under it (kernel, torchrun, ranks) and reported as failed. ``make gpu-check``
(:mod:`course_lib.bench.gpucheck`) schedules the same per-notebook processes
beside nbval and the benchmarks through :func:`notebook_task` and :func:`run_tasks`.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def notebooks(solutions, only=None):
    """The solution notebooks ``NN_*.ipynb`` of a folder, in order; ``only``: numbers kept."""
    return [nb for nb in sorted(Path(solutions).glob("[0-9][0-9]_*.ipynb"))
            if not only or nb.name[:2] in only]


def _error_line(exc):
    """One line for a summary: a notebook's failing cell by its exception's first line
    (papermill's text ends with the traceback's last line, which for a multi-line message
    is its tail), anything else by the last line of its text."""
    if getattr(exc, "ename", None):
        first = next((ln for ln in str(exc.evalue).splitlines() if ln.strip()), "")
        return f"{type(exc).__name__}: {exc.ename}: {first.strip()}"[:400]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1][:300] if text else ''}"


def run_notebook(nb, out, params, timeout=1800):
    """Execute one notebook with papermill in this process (``timeout``: seconds per
    cell): ``(name, seconds, error or None)``."""
    import papermill as pm

    from course_lib.grading.kernels import ipc_manager

    nb, out = Path(nb), Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"=== {nb.name}", flush=True)
    try:
        pm.execute_notebook(str(nb), str(out / nb.name), kernel_name="python3",
                            parameters={**params, "OUTPUT_DIR": str(out)},
                            cwd=str(nb.parent), log_output=True,
                            execution_timeout=timeout, progress_bar=False,
                            kernel_manager_class=ipc_manager())
        error = None
    except Exception as exc:  # noqa: BLE001 - reported per notebook, then summarised
        error = _error_line(exc)
    return nb.name, time.perf_counter() - started, error


# -- processes side by side ---------------------------------------------------------------

@dataclass
class Task:
    """One command in a process of its own, its output in ``log``.

    ``pool``: tasks of one pool share its limit (:func:`run_tasks`); ``after``: names or
    pools of tasks that must have ended before this one starts; ``timeout``: wall seconds,
    after which the process and everything under it is stopped (cut to end by
    ``deadline``, and by :func:`run_tasks`'s)."""
    name: str
    argv: list
    log: Path
    timeout: float | None = None
    deadline: float | None = None  # a time.monotonic() value: the timeout is cut to end by it
    pool: str = "default"
    after: tuple = ()
    cwd: str | None = None
    env: dict | None = None
    returncode: int | None = None
    timed_out: bool = False
    not_run: str | None = None  # why it never started (the time budget ran out)
    started_s: float | None = None  # from the start of run_tasks
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)  # what the caller needs to read the result

    @property
    def done(self):
        return self.returncode is not None or self.not_run is not None

    def log_tail(self, lines=20):
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def kill_tree(pid, grace=5.0):
    """End a process we started and every process under it (a notebook's kernel,
    torchrun and its ranks sit in sessions of their own, so a process group is not enough)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)


def run_tasks(tasks, limits=None, total=None, deadline=None, min_start_s=10.0, echo=True):
    """Run every task's command in a process of its own, each in list order as soon as
    the tasks named in its ``after`` have ended and its pool (``limits[pool]``, default
    unbounded) and the whole (``total``) have room. ``deadline`` (a ``time.monotonic()``
    value) caps each task's timeout; a task that could get under ``min_start_s`` is not
    started. Returns the tasks, filled in (``returncode``, ``timed_out``, ``seconds``)."""
    limits = limits or {}
    pending, running = list(tasks), {}
    t0 = time.monotonic()

    def ended(name):
        return all(t.done for t in tasks if name in (t.name, t.pool))

    try:
        while pending or running:
            for task in list(pending):
                if total is not None and len(running) >= total:
                    break
                busy = sum(t.pool == task.pool for t in running.values())
                if busy >= limits.get(task.pool, len(tasks)) or not all(map(ended, task.after)):
                    continue
                pending.remove(task)
                timeout = task.timeout
                ends = [d for d in (deadline, task.deadline) if d is not None]
                if ends:
                    left = min(ends) - time.monotonic()
                    if left < min_start_s:
                        task.not_run = f"not started: {left:.0f} s left of the time budget"
                        if echo:
                            print(f"--- {task.name}: {task.not_run}", flush=True)
                        continue
                    timeout = left if timeout is None else min(timeout, left)
                task.log.parent.mkdir(parents=True, exist_ok=True)
                log = open(task.log, "w")
                proc = subprocess.Popen(task.argv, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=task.cwd,
                                        env={**os.environ, **(task.env or {})})
                log.close()
                task.started_s = time.monotonic() - t0
                running[proc.pid] = task
                task.extra["_proc"], task.extra["_until"] = proc, (
                    None if timeout is None else time.monotonic() + timeout)
                if echo:
                    print(f"--- {task.name}: started at {task.started_s:.0f} s"
                          + ("" if timeout is None else f" (timeout {timeout:.0f} s)"), flush=True)
            for pid, task in list(running.items()):
                proc, until = task.extra["_proc"], task.extra["_until"]
                if proc.poll() is None and until is not None and time.monotonic() > until:
                    task.timed_out = True
                    kill_tree(pid)
                    proc.wait()
                if proc.poll() is not None:
                    task.returncode = proc.returncode
                    task.seconds = time.monotonic() - t0 - task.started_s
                    del running[pid]
                    if echo:
                        how = "timed out" if task.timed_out else f"exit {task.returncode}"
                        print(f"--- {task.name}: {how} after {task.seconds:.0f} s", flush=True)
            time.sleep(0.2)
    finally:  # interrupted: nothing we started is left running
        for pid in list(running):
            kill_tree(pid)
    for task in tasks:
        task.extra.pop("_proc", None), task.extra.pop("_until", None)
    return tasks


def notebook_task(nb, out, params, timeout=1800, wall_timeout=None, pool="notebooks"):
    """The :class:`Task` that executes one notebook in a process of its own (this module
    with ``--only NN --result FILE``); :func:`notebook_result` reads what it did."""
    nb, out = Path(nb).resolve(), Path(out).resolve()
    result = out / "logs" / f"{nb.stem}.result.json"
    argv = [sys.executable, "-m", "course_lib.grading.runall", "--solutions", str(nb.parent),
            "--only", nb.name[:2], "--out", str(out), "--params", json.dumps(params),
            "--cell-timeout", str(timeout), "--result", str(result)]
    return Task(name=nb.name, argv=argv, log=out / "logs" / f"{nb.stem}.log",
                timeout=wall_timeout, pool=pool,
                env={"PYTHONUNBUFFERED": "1"}, extra={"result": result})


def notebook_result(task):
    """``(name, seconds, error or None)`` of a finished :func:`notebook_task`."""
    if task.not_run:
        return task.name, 0.0, task.not_run
    if task.timed_out:
        return task.name, task.seconds, f"Timeout: stopped after {task.seconds:.0f} s (wall)"
    try:
        (row,) = json.loads(Path(task.extra["result"]).read_text())
        return row["notebook"], row["seconds"], row["error"]
    except (OSError, ValueError):
        last = task.log_tail(1) or "no output"
        return task.name, task.seconds, f"exit {task.returncode}: {last[:300]}"


def run_notebooks(solutions, out, params, only=None, timeout=1800, parallel=1,
                  wall_timeout=None):
    """Execute the notebooks: ``[(name, seconds, error or None)]``. One after the other in
    this process, or with ``parallel`` > 1 (or a ``wall_timeout``) each in a process of its
    own, at most ``parallel`` at once."""
    nbs = notebooks(solutions, only)
    if parallel <= 1 and wall_timeout is None:
        return [run_notebook(nb, out, params, timeout) for nb in nbs]
    tasks = [notebook_task(nb, out, params, timeout, wall_timeout) for nb in nbs]
    run_tasks(tasks, limits={"notebooks": max(1, parallel)})
    return [notebook_result(t) for t in tasks]


def write_summary(path, results):
    """One row per notebook: notebook, status (ok / failed), seconds, error."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", "status", "seconds", "error"])
        for name, seconds, error in results:
            writer.writerow([name, "ok" if error is None else "failed", f"{seconds:.1f}",
                             error or ""])


def main(argv=None):
    import logging

    # papermill's --log-output goes through logging: show each cell's output live
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.runall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--solutions", default="solutions")
    parser.add_argument("--out", default=None, help="default: runs/<timestamp>")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nproc", type=int, default=None)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--only", default=None, help="comma-separated notebook numbers")
    parser.add_argument("--parallel", type=int, default=1,
                        help="notebooks side by side, each in a process of its own")
    parser.add_argument("--notebook-timeout", type=float, default=None,
                        help="wall seconds for one notebook (then it is stopped, and failed)")
    parser.add_argument("--cell-timeout", type=float, default=1800, help="seconds per cell")
    parser.add_argument("--params", default=None,
                        help="JSON object of parameters, over --quick/--nproc/--backend")
    parser.add_argument("--result", default=None,
                        help="write the results as JSON here instead of summary.csv "
                             "(one notebook's process, run by --parallel and make gpu-check)")
    ns = parser.parse_args(argv)
    out = ns.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
    params = {"QUICK": ns.quick, "BACKEND": ns.backend}
    if ns.nproc:
        params["NPROC"] = ns.nproc
    if ns.params:
        params.update(json.loads(ns.params))
    only = set(ns.only.split(",")) if ns.only else None
    results = run_notebooks(ns.solutions, out, params, only, timeout=ns.cell_timeout,
                            parallel=ns.parallel, wall_timeout=ns.notebook_timeout)
    if ns.result:
        Path(ns.result).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.result).write_text(json.dumps(
            [{"notebook": n, "seconds": s, "error": e} for n, s, e in results]))
    if not results:
        print("no notebooks ran", file=sys.stderr)
        return 1
    print(f"\n{'notebook':<28}{'seconds':>9}  status")
    for name, seconds, error in results:
        print(f"{name:<28}{seconds:>9.1f}  {'ok' if error is None else 'FAILED ' + error}")
    if not ns.result:
        write_summary(Path(out) / "summary.csv", results)
        print(f"\nexecuted notebooks, timelines, traces and summary.csv: {Path(out).resolve()}")
    return 0 if all(e is None for *_, e in results) else 1


if __name__ == "__main__":
    sys.exit(main())
