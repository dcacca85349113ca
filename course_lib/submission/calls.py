"""A call of the student's code that a check asks for, and how the student's side runs it.

A :class:`Request` names a *harness* (a function of the grader's that calls the
student's objects and reports what they did), its arguments, and where to run
it: on ``nproc`` real ranks (``kind="ranks"``) or in the student's own process
(``kind="here"``). The student's objects appear among the arguments as
:class:`Student` placeholders, bound by name on the student's side (:func:`bind`).

In the gradebook the harness travels *by value* from the judge (cloudpickle): the
function that runs is the one the judge sent, never one looked up by name where
the student's code could have replaced it. :func:`execute` runs a bound request
and returns an *outcome*, plain data (:mod:`course_lib.submission.plain`): the
answer, or what went wrong. It compares nothing; the judge decides.
"""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field

from course_lib.submission import plain

_GLOO_ABORT = re.compile(r"what\(\):\s*(?:\[enforce fail at [^\]]*\]\s*)?(?P<what>.+)")


@dataclass(frozen=True)
class Student:
    """The student's object called ``name`` in the submission (bound on the student's side)."""
    name: str


@dataclass(frozen=True)
class Request:
    kind: str  # "ranks" or "here"
    harness: object  # the grader's function, which travels by value
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    nproc: int = 1
    timeout: float = 60.0
    fresh: bool = False  # a new job rather than the warm one


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


def execute(request, keep=None):
    """Run a bound request; returns its outcome as plain data (never raises for what
    the student's code does). ``keep``, a dict, receives a hang's stack dumps and
    diagnosis (``stacks``, ``diagnosis``) for a caller in the same process."""
    from course_lib.runtime.launcher import LaunchError, LaunchTimeout, run

    harness = request.harness
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
