"""Grading one submission: its code runs in a sandbox, its checks are decided here.

The judge is the gradebook's trusted half. It starts the submission's
collector in a sandbox (:mod:`course_lib.grading.sandbox`), sends it the
notebook's code cells one at a time, and at each check cell runs the check
itself: the check's generator (:func:`course_lib.grading.checks.check`) yields
requests, the collector runs them with the student's objects and answers with
plain data, and the check compares that data with references it computes in
this process, which never ran student code. A pass is what the check returned
here; nothing the notebook prints or raises is read as a verdict.

Before a check, the judge reads the student's code (:mod:`course_lib.grading.source`)
for stubs and for course_lib's own implementation of the exercise, and asks the
collector the same of the live objects; either fails the exercise.

Two modes:

- checks only (the default): the cells the lab marks ``setup``, the exercise
  cells, cells the student added, and the checks; the demos, benchmarks and
  plots are left out;
- ``full``: every cell, with its outputs (figures included) kept in the
  executed notebook, and each check cell showing the judge's verdict.

Each cell has ``cell_timeout`` seconds and the notebook ``timeout`` in all; a
cell that outlives its time is interrupted (the notebook goes on if the
collector answers again), and a collector that dies ends the notebook's run.
"""
from __future__ import annotations

import ast
import importlib
import time
from dataclasses import dataclass, field

from nbformat.v4 import new_output

from course_lib.grading import apart, checks, salt
from course_lib.grading import hidden as hidden_settings
from course_lib.grading.requests import (Student, here, inspect_students, interpret,
                                         not_implemented)
from course_lib.grading.sandbox import Sandbox, SandboxError
from course_lib.grading.source import Source

RECOVER_S = 30.0  # how long an interrupted collector may take to answer again
REQUEST_SLACK_S = 90.0  # beyond a ranks request's own timeout: a cold job, stack dumps


@dataclass
class Judged:
    nb: object  # the notebook as it ran
    status: str = "ok"  # ok, timeout, crashed, error
    detail: str = ""
    results: dict = field(default_factory=dict)  # exercise -> (pass|fail|error|timeout, message)
    timed_out: list = field(default_factory=list)  # indices of cells stopped at their time
    sandboxed: bool = True
    seconds: float = 0.0
    leftovers: list = field(default_factory=list)


class _Stop(Exception):
    """The notebook's run ends here (``status``, ``detail``)."""

    def __init__(self, status, detail):
        super().__init__(detail)
        self.status, self.detail = status, detail


def check_calls(source, check_names):
    """[(check function, student names, options)] of a check cell: each statement calls a
    check of the lab's check modules with the student's names and literal options."""
    calls = []
    for statement in ast.parse(source).body:
        call = getattr(statement, "value", None)
        func = getattr(call, "func", None)
        if not (isinstance(statement, ast.Expr) and isinstance(call, ast.Call)
                and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                and func.value.id in check_names):
            raise ValueError(f"a check cell may only call checks, got: {ast.unparse(statement)}")
        module, _, attr = check_names[func.value.id].partition(":")
        target = importlib.import_module(module)
        target = getattr(target, attr) if attr else target
        fn = getattr(target, func.attr)
        if not hasattr(fn, "steps"):
            raise ValueError(f"{func.value.id}.{func.attr} is not a check")
        if not all(isinstance(a, ast.Name) for a in call.args):
            raise ValueError(f"a check takes the student's objects by name: {ast.unparse(call)}")
        options = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        calls.append((fn, [a.id for a in call.args], options))
    return calls


def cells_to_run(nb, lab, checks_by_id, full):
    """Indices of the code cells the collector runs (check cells are the judge's)."""
    chosen = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.strip() or cell.get("id") in checks_by_id:
            continue
        tags = cell.metadata.get("tags", [])
        ident = cell.get("id")
        if full or "injected-parameters" in tags or "parameters" in tags \
                or ident in lab.setup_ids or ident in lab.solution_ids \
                or ident not in lab.cell_ids:
            chosen.append(index)
    return chosen


class _Run:
    def __init__(self, nb, lab, checks_by_id, sandbox, deadline, cell_timeout, hidden=None):
        self.nb, self.lab, self.checks_by_id = nb, lab, checks_by_id
        self.hidden = hidden  # (secret, student): draw hidden settings; None: visible only
        self.sandbox, self.deadline, self.cell_timeout = sandbox, deadline, cell_timeout
        self.source = Source([(i, c.source) for i, c in enumerate(nb.cells)
                              if c.cell_type == "code" and c.get("id") not in checks_by_id])
        self.results, self.timed_out = {}, []
        # answers sent by value to items not yet decided (ended before those items run)
        self.account = apart.Account(lab.exercise_ids, sandbox.end_ranks)

    def left(self):
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _Stop("timeout", "the notebook ran out of time")
        return left

    def ask(self, message, timeout, index):
        """A reply, interrupting (and recovering) a collector that outlives ``timeout``."""
        try:
            return self.sandbox.ask(message, min(timeout, self.left()))
        except SandboxError as exc:
            if exc.reason == "died":
                raise _Stop("crashed", f"the submission's process died in cell {index + 1}") \
                    from None
        self.timed_out.append(index)
        self.sandbox.interrupt()
        try:
            self.sandbox.wait_reply(min(RECOVER_S, max(1.0, self.deadline - time.monotonic())))
        except SandboxError:
            raise _Stop("timeout", f"cell {index + 1} ran out of time and did not stop "
                                   f"when interrupted") from None
        return None

    # ---- a code cell ------------------------------------------------------------------------
    def cell(self, index):
        cell = self.nb.cells[index]
        reply = self.ask({"op": "cell", "source": cell.source}, self.cell_timeout, index)
        if reply is None:
            cell.outputs = [new_output("error", ename="CellTimeoutError", traceback=[],
                                       evalue=f"the grader stopped this cell after "
                                              f"{self.cell_timeout:.0f} s")]
            return
        cell.outputs = _outputs(reply)

    # ---- a check cell -----------------------------------------------------------------------
    def check_cell(self, index):
        cell, exercise = self.nb.cells[index], self.checks_by_id[self.nb.cells[index].get("id")]
        source = next(c.source for c in self.lab.checks if c.id == cell.get("id"))
        try:
            calls = check_calls(source, self.lab.check_names)
        except (ValueError, SyntaxError, ImportError, AttributeError) as exc:
            calls, result = [], ("error", f"{exercise}: the grader cannot read this check "
                                          f"cell ({type(exc).__name__}: {exc})")
        try:
            if calls:
                lines = [self.check(fn, names, options, index) for fn, names, options in calls]
                result = ("pass", "\n".join(lines))
        except (checks.CheckFailed, NotImplementedError) as exc:
            result = ("fail", str(exc))
        except _Timeout as exc:
            result = ("timeout", str(exc))
        except Exception as exc:  # noqa: BLE001 - the answer did not have the expected shape
            result = ("fail", f"{exercise}: the check could not use what your code returned "
                              f"({type(exc).__name__}: {exc})")
        self.results[exercise] = result
        passed = result[0] == "pass"
        cell.outputs = [new_output("stream", name="stdout", text=result[1] + "\n")] if passed else \
            [new_output("error", ename="CheckFailed", evalue=result[1], traceback=[])]
        self.ask({"op": "outcome", "exercise": exercise,
                  "state": "passed" if passed else "failed"}, 30, index)

    def check(self, fn, names, options, index):
        def ask(message, timeout):
            return self.ask(message, timeout, index)

        seed = hidden_settings.seed(*self.hidden, fn.exercise) if self.hidden else None
        try:
            return judge_check(fn, names, options, ask, self.source, index,
                               here_timeout=self.cell_timeout, seed=seed,
                               route=self.account.route)
        finally:
            self.account.decide(fn.exercise)


class _Timeout(Exception):
    pass


def judge_check(fn, names, options, ask, source=None, before=None, here_timeout=300.0,
                seed=None, route=apart.given):
    """Decide one call of check ``fn`` on the student's objects ``names`` (with ``options``):
    returns the pass line, or raises CheckFailed / NotImplementedError. ``ask(message,
    timeout)`` gets the collector's reply (None when it was interrupted); ``source`` (a
    :class:`~course_lib.grading.source.Source`) is the student's code, read for stubs and
    course_lib's implementations in the cells before ``before``. With ``seed``, a check
    that draws hidden settings (``fn.hidden``) runs on them too, after the visible ones
    pass; its failure there is told without the drawn numbers (:mod:`.hidden`).
    ``route(exercise, request, here_timeout)`` says where a request runs (:mod:`.apart`)."""
    exercise = fn.exercise
    found = []
    if source is not None:
        if source.stubs(names, before):
            raise NotImplementedError(not_implemented(exercise))
        found = source.references(exercise, names, before)
    # the inspection travels as a request (its code by value, as every harness's)
    inspection = here(inspect_students, exercise, *(Student(n) for n in names))
    seen = ask({"op": "request", "exercise": exercise, "request": inspection}, 60) or {}
    if "missing" in seen:
        raise checks.CheckFailed(f"{exercise}: your notebook does not define "
                                 f"{seen['missing']!r} (run its code cell before the check).",
                                 exercise=exercise)
    try:
        seen = interpret(exercise, inspection, seen) if "ok" in seen else {}
    except checks.CheckFailed:
        seen = {}
    if not isinstance(seen, dict):
        seen = {}
    if seen.get("stub"):
        raise NotImplementedError(not_implemented(exercise))
    found += [line for line in seen.get("references") or [] if isinstance(line, str)]
    if found:
        raise checks.refusal(exercise, found)

    def answer(request):
        request = salt.carried(request)  # a hidden run's salt goes where the request runs
        # an answer that travels with it stays away from the student's own process
        request, unwrap = route(exercise, request, here_timeout)
        wait = request.timeout + REQUEST_SLACK_S if request.kind == "ranks" else here_timeout
        outcome = ask({"op": "request", "exercise": exercise, "request": request}, wait)
        if outcome is None:
            raise _Timeout(f"{exercise}: your code did not finish in {wait:g}s and was stopped")
        value = interpret(exercise, request, outcome)
        return value[0] if unwrap else value

    detail = checks.drive(fn.steps(*(Student(n) for n in names), **options), answer)
    if seed is not None and fn.hidden is not None:
        hidden_settings.drive(fn, [Student(n) for n in names], options, seed, answer)
        detail = (detail + "; " if detail else "") + "and on settings drawn for this submission"
    return f"{checks.PASS_MARK} {exercise} passed" + (f" ({detail})" if detail else "")


def _outputs(reply):
    """nbformat outputs from a collector's reply (read as data: strings only)."""
    outputs = []
    for out in reply.get("outputs") or []:
        if not isinstance(out, dict):
            continue
        if out.get("output_type") == "stream" and out.get("name") in ("stdout", "stderr") \
                and isinstance(out.get("text"), str):
            outputs.append(new_output("stream", name=out["name"], text=out["text"]))
        elif out.get("output_type") == "display_data" and isinstance(out.get("data"), dict):
            data = {k: v for k, v in out["data"].items()
                    if isinstance(k, str) and isinstance(v, str) and "/" in k}
            if data:
                outputs.append(new_output("display_data", data=data))
    error = reply.get("error")
    if reply.get("status") == "error" and isinstance(error, dict):
        outputs.append(new_output("error", ename=str(error.get("ename", "Error"))[:100],
                                  evalue=str(error.get("evalue", ""))[:2000], traceback=[]))
    return outputs


def judge_notebook(nb, lab, checks_by_id, workdir, *, full=False, timeout=900.0,
                   cell_timeout=300.0, sandboxed=None, hidden=None):
    """Run ``nb`` (prepared: ``checks_by_id`` maps its restored check cells' ids to
    exercises) against ``lab``; returns a :class:`Judged`. Never raises for what the
    notebook does. ``hidden`` = (the class's secret, the student) also runs each check
    on settings drawn for that student (:mod:`.hidden`)."""
    started = time.monotonic()
    judged = Judged(nb)
    try:
        sandbox = Sandbox(workdir, full=full, sandboxed=sandboxed, hide=lab.exercise_ids)
    except (SandboxError, OSError) as exc:
        judged.status, judged.detail = "error", f"the sandbox did not start: {exc}"
        return judged
    judged.sandboxed = sandbox.sandboxed
    run = _Run(nb, lab, checks_by_id, sandbox, started + timeout, cell_timeout, hidden)
    chosen = set(cells_to_run(nb, lab, checks_by_id, full))
    try:
        for index, cell in enumerate(nb.cells):
            if cell.get("id") in checks_by_id and cell.cell_type == "code":
                run.check_cell(index)
            elif index in chosen:
                run.cell(index)
    except _Stop as stop:
        judged.status, judged.detail = stop.status, stop.detail
    finally:
        judged.leftovers = sandbox.close()
        judged.seconds = time.monotonic() - started
    judged.timed_out = run.timed_out
    for exercise in checks_by_id.values():
        if exercise not in run.results:
            status = "timeout" if judged.status == "timeout" else "error"
            run.results[exercise] = (status, f"not run: {judged.detail or 'the notebook stopped'}")
    judged.results = run.results
    return judged
