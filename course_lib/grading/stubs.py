"""Recognising an exercise the student has not started: its code still holds the stub.

``make labs`` replaces each solution region by ``raise NotImplementedError(...)``.
A check handed such a function would launch a job only to watch every rank
raise at its first line, and a failed job is torn down, so the next check
pays a cold start (seconds). :func:`is_stub` reads the bytecode instead: a
function, or a method of a class, or a function nested in one, whose first
statement raises NotImplementedError, or that still holds labgen's line
``raise NotImplementedError("Exercise N.M: ...")`` after the scaffold lines a
lab keeps above it. Objects of course_lib itself are never stubs (the
reference implementations are what checks compare with).

    def ring_all_gather(output, input):
        raise NotImplementedError("Exercise 1.3: ring all-gather")
    is_stub(ring_all_gather)      # True
"""
from __future__ import annotations

import dis
import inspect
import types

from course_lib.grading import ids

# instructions that may come before a function's first statement
_PROLOGUE = {"RESUME", "NOP", "COPY_FREE_VARS", "MAKE_CELL", "EXTENDED_ARG", "PUSH_NULL",
             "PRECALL", "CACHE"}


def _opens_with_raise(code):
    """Whether ``code``'s first statement is ``raise NotImplementedError[(...)]``."""
    seen_error = False
    for count, ins in enumerate(_instructions(code)):
        if count > 4:  # load the name, a message, call, raise: a stub is short
            return False
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval == "NotImplementedError":
            seen_error = True
        elif ins.opname == "RAISE_VARARGS":
            return seen_error
        elif not seen_error:
            return False
    return False


def _raises_labgen_stub(code):
    """Whether ``code`` holds labgen's own line, ``raise NotImplementedError("Exercise
    N.M: ...")``, anywhere (after scaffold lines the lab keeps, e.g. ``rank = ...``)."""
    ops = [(i.opname, i.argval) for i in _instructions(code)]
    for at in range(len(ops) - 3):
        (load, name), (const, message), (call, _), (raise_, _) = ops[at:at + 4]
        if (load in ("LOAD_GLOBAL", "LOAD_NAME") and name == "NotImplementedError"
                and const == "LOAD_CONST" and isinstance(message, str)
                and message.startswith(ids.KINDS) and call == "CALL"
                and raise_ == "RAISE_VARARGS"):
            return True
    return False


def _instructions(code):
    return [i for i in dis.get_instructions(code) if i.opname not in _PROLOGUE]


def code_is_stub(code):
    """Whether ``code`` (or a code object nested in it) holds the stub."""
    if _opens_with_raise(code) or _raises_labgen_stub(code):
        return True
    return any(isinstance(c, types.CodeType) and code_is_stub(c) for c in code.co_consts)


def is_stub(obj, depth=3):
    """True for a function (or class) written outside course_lib whose body, or one
    of its methods' or nested functions' bodies, holds the stub; also for a function
    that closes over one (a check wraps the student's function in a job)."""
    if depth <= 0:
        return False
    func = getattr(obj, "__func__", obj)
    if inspect.isfunction(func):
        closed_over = [c.cell_contents for c in func.__closure__ or () if _filled(c)]
        if any(is_stub(value, depth - 1) for value in closed_over):
            return True
    if str(getattr(obj, "__module__", "") or "").startswith("course_lib"):
        return False
    if inspect.isclass(obj):
        members = [getattr(m, "__func__", m) for m in vars(obj).values()]
        return any(inspect.isfunction(m) and code_is_stub(m.__code__) for m in members)
    code = getattr(func, "__code__", None)
    return isinstance(code, types.CodeType) and code_is_stub(code)


def _filled(cell):
    try:
        cell.cell_contents
    except ValueError:  # a cell not assigned yet
        return False
    return True
