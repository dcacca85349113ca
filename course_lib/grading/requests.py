"""What a check asks of the student's code, run on the student's side, answered as data.

A check never calls the student's code itself: it *asks* for a run and gets
plain data back (:mod:`course_lib.grading.plain`). Two kinds of request:

- :func:`on_ranks`: run a job function of the grader's (``harness``) on
  ``nproc`` real ranks, handing it the student's objects; the answer is the
  list of what each rank returned;
- :func:`here`: run a grader's function in the student's own process (pure
  logic: a formula, a schedule, a bucket plan); the answer is what it returned.

The harness is a module-level function of course_lib, named by
``module:qualname`` so that a request can travel to another process (the
gradebook's sandbox) and the same function be found there. Where a check cell
runs in a notebook, the student's objects are the live ones; in the gradebook's
judge they are :class:`Student` placeholders, bound by name in the sandbox.

:func:`execute` runs a request on the student's side and returns an *outcome*
(plain data: the answer, or what went wrong); :func:`interpret` turns an outcome
into the answer or into the exception a student reads. In a notebook both run
in the kernel; in the gradebook :func:`execute` runs in the sandbox and
:func:`interpret` in the judge, with the same messages.
"""
from __future__ import annotations

import importlib
import re
import traceback
from dataclasses import dataclass, field

from course_lib.grading import plain
from course_lib.grading.stubs import is_stub

_GLOO_ABORT = re.compile(r"what\(\):\s*(?:\[enforce fail at [^\]]*\]\s*)?(?P<what>.+)")


@dataclass(frozen=True)
class Student:
    """The student's object called ``name`` in the submission (bound in the sandbox)."""
    name: str


@dataclass
class Request:
    kind: str  # "ranks" or "here"
    harness: object  # "module:qualname" (a function only where the request stays in-process)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    nproc: int = 1
    timeout: float = 60.0
    fresh: bool = False  # a new job rather than the warm one


def _name_of(harness):
    """``module:qualname`` of a module-level course_lib function (checked: found again)."""
    module, qualname = getattr(harness, "__module__", ""), getattr(harness, "__qualname__", "")
    name = f"{module}:{qualname}"
    if not module.startswith("course_lib") or "<locals>" in qualname or resolve(name) is not harness:
        raise TypeError(f"a check's harness must be a module-level function of course_lib, "
                        f"not {name}: a request travels to the sandbox by name")
    return name


def resolve(name):
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def on_ranks(harness, *args, nproc, timeout=60.0, fresh=False, **kwargs):
    """Ask for ``harness(*args, **kwargs)`` on every rank of a job of ``nproc`` (gloo,
    CPU ranks: a grade does not depend on the machine); ``fresh=True``: in new processes
    (nothing the previous request left in memory survives)."""
    return Request("ranks", _name_of(harness), args, kwargs, nproc, float(timeout), fresh)


def here(harness, *args, **kwargs):
    """Ask for ``harness(*args, **kwargs)`` in the student's own process."""
    return Request("here", _name_of(harness), args, kwargs)


def call_each(fn, calls):
    """A harness for pure functions: ``fn(*args, **kwargs)`` for each ``(args, kwargs)`` of
    ``calls``, as ``[{"value": result} | {"raised": "TypeError", "message": "..."}]`` (one
    request for many cases). A stub's NotImplementedError ends it."""
    answers = []
    for args, kwargs in calls:
        try:
            answers.append({"value": fn(*args, **kwargs)})
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the answer, for the check to judge
            answers.append({"raised": type(exc).__name__, "message": str(exc)[:500]})
    return answers


def students_in(values):
    """The :class:`Student` placeholders among ``values`` (args and kwargs of a request)."""
    return [v for v in values if isinstance(v, Student)]


# ---- the student's side -------------------------------------------------------------------
def bind(request, namespace):
    """``request`` with its :class:`Student` placeholders replaced from ``namespace``."""
    def value(v):
        if isinstance(v, Student):
            if v.name not in namespace:
                raise NameError(v.name)
            return namespace[v.name]
        return v

    return Request(request.kind, request.harness, tuple(value(v) for v in request.args),
                   {k: value(v) for k, v in request.kwargs.items()}, request.nproc,
                   request.timeout, request.fresh)


def inspect_objects(exercise, objects, references=True):
    """What the grader learns of the student's objects before running them: a stub
    (``{"stub": True}``), course_lib's own implementation (``{"references": [...]}``),
    or nothing (``{}``)."""
    if any(is_stub(obj) for obj in objects):
        return {"stub": True}
    if references:
        from course_lib.grading.references import reference_use

        found = reference_use(exercise, objects)
        if found:
            return {"references": found}
    return {}


def execute(request, keep=None):
    """Run a bound request; returns its outcome as plain data (never raises for what
    the student's code does). ``keep``, a dict, receives a hang's stack dumps and
    diagnosis (``stacks``, ``diagnosis``) for a caller in the same process."""
    from course_lib.runtime.launcher import LaunchError, LaunchTimeout, run

    harness = resolve(request.harness) if isinstance(request.harness, str) else request.harness
    try:
        if request.kind == "ranks":
            value = run(harness, *request.args, nproc=request.nproc, timeout=request.timeout,
                        backend="gloo", fresh=request.fresh, **request.kwargs)
            value = list(value)
        else:
            value = harness(*request.args, **request.kwargs)
    except LaunchTimeout as exc:
        from course_lib.runtime.hangs import diagnose_hang

        diagnosis = getattr(exc, "diagnosis", None) or diagnose_hang(exc.stacks, request.nproc)
        if keep is not None:
            keep.update(stacks=exc.stacks, diagnosis=diagnosis)
        return {"timeout": diagnosis.explain(), "kind": diagnosis.kind}
    except LaunchError as exc:
        if exc.exc_type == "NotImplementedError":
            return {"stub": True}
        found = _GLOO_ABORT.search(exc.log or "")
        # no record, or the first is a rank that died silently (failures._silent_death):
        # an abort of gloo's, explained as such when its message is in the log
        if not exc.errors or (exc.errors[0].get("silent") and found):
            return {"ended": str(exc), "abort": found["what"].strip() if found else None}
        return {"raised": str(exc), "rank": exc.errors[0]["rank"]}
    except NotImplementedError:
        return {"stub": True}
    except Exception as exc:  # noqa: BLE001 - the student's code raised through the harness
        return {"raised": "".join(traceback.format_exception(exc)), "rank": None,
                "type": type(exc).__name__, "message": str(exc)}
    try:
        return {"ok": plain.encode(value)}
    except plain.NotPlain as exc:
        return {"unplain": str(exc)}


# ---- the judge's side ---------------------------------------------------------------------
def not_implemented(exercise):
    return (f"{exercise} is not implemented yet: replace the `raise NotImplementedError` "
            f"in its code cell with your solution, run that cell, then this one.")


def interpret(exercise, request, outcome, kept=None):
    """The answer of ``outcome``, or the exception that tells the student what happened
    (``kept``: what :func:`execute` kept, attached to a hang's exception)."""
    from course_lib.grading.checks import CheckFailed

    n = request.nproc
    if "ok" in outcome:
        try:
            return plain.decode(outcome["ok"])
        except ValueError as exc:
            raise CheckFailed(f"{exercise}: the answer of your code could not be read ({exc}).",
                              exercise=exercise) from None
    if outcome.get("stub"):
        raise NotImplementedError(not_implemented(exercise))
    if "unplain" in outcome:
        raise CheckFailed(f"{exercise}: your code returned something a check cannot take: "
                          f"{outcome['unplain']}.", exercise=exercise)
    if "timeout" in outcome:
        error = CheckFailed(f"{exercise}: with world size {n} your code did not finish in "
                            f"{request.timeout:g}s and was stopped.\n{outcome['timeout']}",
                            exercise=exercise)
        error.stacks, error.diagnosis = (kept or {}).get("stacks"), (kept or {}).get("diagnosis")
        raise error
    if "ended" in outcome:
        if outcome.get("abort"):
            raise CheckFailed(
                f"{exercise}: with world size {n} the gloo backend aborted a rank of your "
                f"job: {outcome['abort']}\nHint: the ranks disagree on the size of a "
                f"message: a collective called with tensors of different sizes or dtypes on "
                f"different ranks, different collectives on different ranks, or a recv into "
                f"a tensor of another size than its send's. Every rank must pass tensors of "
                f"the same shape and dtype to a collective, in the same order.\n\n"
                f"{outcome['ended']}", exercise=exercise)
        raise CheckFailed(
            f"{exercise}: with world size {n} a rank of your job ended without a Python "
            f"error (did your code call sys.exit() or os._exit(), or was the process "
            f"killed?).\n\n{outcome['ended']}", exercise=exercise)
    if "raised" in outcome:
        if request.kind == "ranks":
            raise CheckFailed(f"{exercise}: your code raised on rank {outcome['rank']} "
                              f"(world size {n}).\n\n{outcome['raised']}", exercise=exercise)
        raise CheckFailed(f"{exercise}: your code raised {outcome.get('type', 'an error')}: "
                          f"{outcome.get('message', '')}\n\n{outcome['raised']}",
                          exercise=exercise)
    if "missing" in outcome:
        raise CheckFailed(f"{exercise}: your notebook does not define {outcome['missing']!r} "
                          f"(run its code cell before the check).", exercise=exercise)
    raise CheckFailed(f"{exercise}: the grader could not run your code: {outcome}",
                      exercise=exercise)
