"""Executing one prepared submission in a fresh kernel, bounded in time, leaving nothing.

Cells run one at a time (nbclient) so that the grader can run its own cells
between them (:mod:`course_lib.grading.guard`: first thing in the kernel, and
before and after every restored check cell) and bound each cell and the whole
notebook:

- a cell that outlives its time (``cell_timeout``, or what is left of the
  notebook's ``timeout``) is interrupted, gets an error output saying so, and
  the notebook goes on if the kernel answers again within ``RECOVER_S``;
  otherwise, or once the notebook's time is spent, grading of it stops there;
- a kernel that dies ends the notebook's run (status ``crashed``);
- afterwards every process that carries this run's marker in its environment
  (the kernel, its torchrun jobs, anything they started) is waited for and, if
  still there, killed.

The kernel runs with its working directory in the grader's output folder,
never the submissions folder.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field

import psutil
from nbformat.v4 import new_code_cell, new_output

from course_lib.grading.guard import MARK

RUN_MARKER = "COURSE_LIB_GRADING_RUN"
RECOVER_S = 30.0  # how long an interrupted kernel may take to answer again


@dataclass
class Execution:
    nb: object
    status: str = "ok"  # ok, timeout, crashed, error
    detail: str = ""
    executed: set = field(default_factory=set)  # indices of cells that ran (or started)
    timed_out: set = field(default_factory=set)
    guard: list = field(default_factory=list)  # the guard's events, in order
    seconds: float = 0.0
    leftovers: list = field(default_factory=list)  # processes the grader had to kill


def _guard_events(cell):
    events = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            for line in out.get("text", "").splitlines():
                if line.startswith(MARK):
                    events.append(json.loads(line[len(MARK):]))
        elif out.get("output_type") == "error":
            events.append({"event": "error", "message": f"{out.ename}: {out.evalue}"[:300]})
    return events


class _Kernel:
    def __init__(self, client, nb, execution):
        self.client, self.nb, self.execution = client, nb, execution
        self.replies = []
        client.on_cell_executed = lambda cell, cell_index, execute_reply: \
            self.replies.append((execute_reply or {}).get("content", {}))

    def cell(self, index, timeout, hidden=False):
        """Run one cell: "ok", "timeout" or "dead"."""
        from nbclient.exceptions import DeadKernelError

        cell = self.nb.cells[index]
        self.client.timeout = max(1, int(timeout))
        # On a timeout nbclient interrupts the kernel and hands back this reply, after
        # waiting a few seconds for the cell's last output: its reader of the kernel's
        # output is then done (when nbclient raises CellTimeoutError instead, that
        # reader lives on and swallows the next cells' output).
        self.client.error_on_timeout = {"ename": "CellTimeoutError", "traceback": [],
                                        "evalue": f"the grader stopped this cell after "
                                                  f"{timeout:.0f} s"}
        self.replies.clear()
        try:
            self.client.execute_cell(cell, index, store_history=not hidden,
                                     execution_count=None if hidden else
                                     self.client.code_cells_executed + 1)
        except DeadKernelError:
            cell.outputs.append(new_output("error", ename="DeadKernelError", traceback=[],
                                           evalue="the kernel died while this cell ran"))
            return "dead"
        reply = self.replies[-1] if self.replies else {}
        if reply.get("ename") == "CellTimeoutError":
            cell.outputs.append(new_output("error", ename="CellTimeoutError", traceback=[],
                                           evalue=reply["evalue"]))
            return "timeout"
        return "ok"

    def hidden(self, source, timeout):
        """Run a cell of the grader's (not kept in the notebook): (outcome, events)."""
        self.nb.cells.append(new_code_cell(source))
        try:
            outcome = self.cell(len(self.nb.cells) - 1, timeout, hidden=True)
            return outcome, _guard_events(self.nb.cells[-1])
        finally:
            self.nb.cells.pop()

    def recover(self, left):
        """After a cell's timeout (the kernel was interrupted): does it answer again?"""
        outcome, _ = self.hidden("pass", min(RECOVER_S, max(left, 1)))
        return outcome == "ok"


def execute(nb, checks, check_modules, check_names, workdir, timeout=900.0, cell_timeout=300.0,
            env=None):
    """Run ``nb`` (prepared: ``checks`` maps restored check cell ids to exercises) in a new
    kernel in ``workdir``. Returns an :class:`Execution`; never raises for what the
    notebook does."""
    from nbclient import NotebookClient

    token = uuid.uuid4().hex
    kernel_env = {**os.environ, **(env or {}), RUN_MARKER: token,
                  "COURSE_LIB_REFERENCE_GUARD": "1", "PYTHONUNBUFFERED": "1"}
    execution = Execution(nb)
    started = time.monotonic()
    deadline = started + timeout
    client = NotebookClient(nb, timeout=int(cell_timeout), kernel_name="python3",
                            allow_errors=True, interrupt_on_timeout=True,
                            resources={"metadata": {"path": str(workdir)}})
    try:
        with client.setup_kernel(env=kernel_env, cwd=str(workdir)):
            _run_cells(_Kernel(client, nb, execution), nb, checks, check_modules, check_names,
                       deadline, cell_timeout)
            if execution.status != "ok":
                client.shutdown_kernel = "immediate"
    except Exception as exc:  # noqa: BLE001 - the kernel would not start, or nbclient failed
        execution.status = "error"
        execution.detail = f"the grader could not run the notebook: {type(exc).__name__}: " \
                           f"{str(exc).strip()[:200]}"
    finally:
        execution.leftovers = end_processes(token)
        execution.seconds = time.monotonic() - started
    return execution


def _run_cells(kernel, nb, checks, check_modules, check_names, deadline, cell_timeout):
    execution = kernel.execution
    outcome, events = kernel.hidden(
        "import course_lib.grading.guard as __course_lib_guard\n"
        f"__course_lib_guard.install({check_modules!r})", max(1, min(300, deadline - time.monotonic())))
    execution.guard += events
    if outcome != "ok":
        execution.status = "crashed" if outcome == "dead" else "timeout"
        execution.detail = "the kernel did not start the grader's first cell"
        return
    for index in range(len(nb.cells)):
        cell = nb.cells[index]
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            execution.status = "timeout"
            execution.detail = f"ran out of time before cell {index + 1}"
            return
        exercise = checks.get(cell.get("id"))
        if exercise is not None:
            outcome, events = kernel.hidden(
                f"__course_lib_guard.before_check({exercise!r}, {check_names!r})", min(60, left))
            execution.guard += [{**e, "exercise": exercise} for e in events]
            if outcome != "ok":
                return _stop(execution, outcome, index, "the grader's cell before this check")
        execution.executed.add(index)
        outcome = kernel.cell(index, min(cell_timeout, deadline - time.monotonic()))
        if outcome == "timeout":
            execution.timed_out.add(index)
            if not kernel.recover(deadline - time.monotonic()):
                return _stop(execution, "timeout", index, "it did not stop when interrupted")
        elif outcome == "dead":
            return _stop(execution, outcome, index, "")
        if exercise is not None:
            outcome, events = kernel.hidden(f"__course_lib_guard.after_check({exercise!r})",
                                            max(1, min(60, deadline - time.monotonic())))
            execution.guard += [{**e, "exercise": exercise} for e in events]
            if outcome != "ok":
                return _stop(execution, outcome, index, "the grader's cell after this check")


def _stop(execution, outcome, index, why):
    execution.status = "crashed" if outcome == "dead" else "timeout"
    execution.detail = (f"the kernel died in cell {index + 1}" if outcome == "dead" else
                        f"cell {index + 1} ran out of time" + (f" ({why})" if why else ""))


def run_processes(token):
    """Live processes carrying ``token`` as this run's marker."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(RUN_MARKER) == token:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def end_processes(token, grace_s=15.0):
    """Wait up to ``grace_s`` for the run's processes to end (a kernel's jobs follow it
    within a second or two), kill what is left, and say what had to be killed."""
    deadline = time.monotonic() + grace_s
    left = run_processes(token)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = run_processes(token)
    killed = []
    for proc in left:
        try:
            killed.append(f"pid {proc.pid} ({' '.join(proc.cmdline()[:3])[:80]})")
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=10)
    return killed
