"""What a check asks of the student's code, run on the student's side, answered as data.

A check never calls the student's code itself: it *asks* for a run and gets
plain data back (:mod:`course_lib.submission.plain`). Two kinds of request:

- :func:`on_ranks`: run a job function of the grader's (``harness``) on
  ``nproc`` real ranks, handing it the student's objects; the answer is the
  list of what each rank returned;
- :func:`here`: run a grader's function in the student's own process (pure
  logic: a formula, a schedule, a bucket plan); the answer is what it returned.

The harness is a module-level function of the grader's; in the gradebook it travels
to the sandbox *by value* (the sandbox holds no ``course_lib.grading`` to look it up
in, so nothing the student's code replaced there is what runs). Where a check cell
runs in a notebook, the student's objects are the live ones; in the gradebook's
judge they are :class:`Student` placeholders, bound by name in the sandbox.

:func:`~course_lib.submission.calls.execute` runs a request on the student's side and
returns an *outcome* (plain data: the answer, or what went wrong); :func:`interpret`
turns an outcome into the answer or into the exception a student reads. In a notebook
both run in the kernel; in the gradebook ``execute`` runs in the sandbox and
:func:`interpret` in the judge, with the same messages.
"""
from __future__ import annotations

from course_lib.grading import wire
from course_lib.grading.references import reference_use
from course_lib.grading.stubs import is_stub
from course_lib.submission import plain
from course_lib.submission.calls import Request, Student, bind, execute  # noqa: F401

SEAL_BROKEN = "the instruments the check reads were written to or taken out"


def _checked(harness):
    """``harness`` itself, once it is known to be a module-level function of the grader's
    (a request carries it by value to the student's side, so it must be the grader's own
    code, never a function the student's process could have handed in)."""
    module, qualname = getattr(harness, "__module__", ""), getattr(harness, "__qualname__", "")
    if not module.startswith("course_lib") or "<locals>" in qualname or not callable(harness):
        raise TypeError(f"a check's harness must be a module-level function of course_lib, "
                        f"not {module}:{qualname}")
    return harness


def on_ranks(harness, *args, nproc, timeout=60.0, fresh=False, **kwargs):
    """Ask for ``harness(*args, **kwargs)`` on every rank of a job of ``nproc`` (gloo,
    CPU ranks: a grade does not depend on the machine); ``fresh=True``: in new processes
    (nothing the previous request left in memory survives)."""
    return Request("ranks", _checked(harness), args, kwargs, nproc, float(timeout), fresh)


def here(harness, *args, **kwargs):
    """Ask for ``harness(*args, **kwargs)`` in the student's own process."""
    return Request("here", _checked(harness), args, kwargs)


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


def inspect_objects(exercise, objects, references=True):
    """What the grader learns of the student's objects before running them: a stub
    (``{"stub": True}``), course_lib's own implementation (``{"references": [...]}``),
    or nothing (``{}``)."""
    if any(is_stub(obj) for obj in objects):
        return {"stub": True}
    if references:
        found = reference_use(exercise, objects)
        if found:
            return {"references": found}
    return {}


def inspect_students(exercise, *objects):
    """:func:`inspect_objects` as a harness: the judge sends it with the student's objects
    as placeholders, by value, to run on the student's side."""
    return inspect_objects(exercise, list(objects))


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
            answer = plain.decode(outcome["ok"])
        except ValueError as exc:
            raise CheckFailed(f"{exercise}: the answer of your code could not be read ({exc}).",
                              exercise=exercise) from None
        why = wire.broken(answer)
        if why:
            raise CheckFailed(f"{exercise}: {SEAL_BROKEN} while your code ran ({why}); the "
                              f"traffic cannot be graded.", exercise=exercise)
        called = wire.broken(answer, wire.NOT_P2P)
        if called:
            raise CheckFailed(f"{exercise}: this exercise is built from point-to-point "
                              f"messages only (course_lib.comm's send, recv and exchange), but "
                              f"your code called the process group's collective(s) {called}.",
                              exercise=exercise)
        return answer
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
