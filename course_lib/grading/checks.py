"""Grading a student's distributed code from a check cell.

A check runs the student's function under real torchrun (several world sizes,
odd ones included), compares every rank's answer with an independent
reference, and either prints ``✓ Exercise N.M passed ...`` (what the gradebook
looks for) or raises with something a student can act on::

    outs = checks.launch("Exercise 0.2", token_ring, torch.arange(7.0), nproc=3)
    for rank, got in enumerate(outs):
        checks.expect_close("Exercise 0.2", got, expected[rank], rank=rank, world_size=3,
                            what="token", hint="did each rank add its own rank?")
    checks.passed("Exercise 0.2", "world sizes 2 and 3")

A stub that still raises ``NotImplementedError`` surfaces as NotImplementedError
naming the exercise; code that is, or calls, course_lib's own implementation of
the exercise (:mod:`course_lib.grading.references`) as :class:`CheckFailed`
saying so (in a notebook kernel, or wherever ``COURSE_LIB_REFERENCE_GUARD=1``); a
hang as :class:`CheckFailed` that says what kind of hang it is (ranks in different
collectives, a rank missing from a collective, sends and receives that do not pair
up...), naming each rank and the call it waits in, with every rank's stack trimmed
to the student's code (the untrimmed dumps are the exception's ``.stacks``).

The kernel remembers how each exercise's last check ended: a measurement cell
that runs the student's code asks :func:`ready` first, and skips (saying so)
instead of hanging on code whose check failed::

    if checks.ready("Exercise 2.3"):
        sweep = measure(my_ddp)
"""
from __future__ import annotations

import functools
import os
import sys
import threading

import cloudpickle
import torch

from course_lib.submission import plain
from course_lib.grading.requests import (Request, execute, inspect_objects, interpret,
                                         not_implemented)
from course_lib.grading.outcomes import (CheckFailed, _key, _outcomes, _record,  # noqa: F401
                                         outcome, ready)
from course_lib.grading.stubs import is_stub

PASS_MARK = "✓"

def _not_implemented(exercise):
    return not_implemented(exercise)


# ---- refusing course_lib's own implementation of the exercise --------------------------------
_reference_guard = None  # None: COURSE_LIB_REFERENCE_GUARD decides ("auto": in a notebook kernel)


def guard_references(enabled=True):
    """Turn the reference check on or off in this process (None: back to the environment's
    ``COURSE_LIB_REFERENCE_GUARD``: ``1``, ``0`` or ``auto``, on in a Jupyter kernel). The
    library's tests hand the references to the checks as known-good answers, so outside a
    kernel it is off unless asked for; the gradebook's judge reads the student's source
    for the same thing."""
    global _reference_guard
    _reference_guard = enabled


def _guarding():
    if _reference_guard is not None:
        return _reference_guard
    setting = os.environ.get("COURSE_LIB_REFERENCE_GUARD", "auto").strip().lower()
    if setting in ("1", "on", "true", "yes"):
        return True
    if setting in ("0", "off", "false", "no"):
        return False
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return getattr(shell, "kernel", None) is not None


def refusal(exercise, found):
    """The failure for code that is, or calls, course_lib's implementation of ``exercise``."""
    return CheckFailed(
        f"{exercise}: your code uses course_lib's own implementation of this exercise "
        f"({'; '.join(found)}). The exercise is to write it yourself: a check does not "
        f"accept the library's version, called directly or through your code.",
        exercise=exercise)


def _refuse_references(exercise, objects):
    if not _guarding():
        return
    from course_lib.grading.references import reference_use

    found = reference_use(exercise, objects)
    if found:
        raise refusal(exercise, found)


# ---- a check: a generator of requests, driven here or by the gradebook's judge ---------------
def check(exercise, hidden=None):
    """Make a generator of :mod:`~course_lib.grading.requests` a check of ``exercise``.

    ``hidden(rng)`` (a :class:`random.Random`) draws options for one more run that only
    the gradebook's judge makes, seeded per submission and never shown: settings a
    student has not seen, so that a table of the visible cases' answers fails there.

    The generator takes the student's objects (positional) and options (keywords),
    yields a request whenever it needs the student's code run, receives the answer as
    plain data, compares with its own references (raising :class:`CheckFailed`), and
    returns the detail of the pass line. Called from a check cell, the check runs in
    this process and prints the pass line; the gradebook's judge drives ``.steps``
    against the submission's sandbox instead::

        @checks.check("Exercise 0.2")
        def check_token_ring(token_ring, world_sizes=(2, 3)):
            for n in world_sizes:
                outs = yield requests.on_ranks(jobs.counted, token_ring, TOKEN, nproc=n)
                ...                        # compare outs with the expected tokens
            return f"world sizes {list(world_sizes)}"
    """
    def wrap(steps):
        @functools.wraps(steps)
        def in_this_process(*student, **options):
            _record(exercise, "checking")
            try:
                seen = inspect_objects(exercise, student, references=_guarding())
                if seen.get("stub"):
                    raise NotImplementedError(not_implemented(exercise))
                if seen.get("references"):
                    raise refusal(exercise, seen["references"])
                detail = drive(steps(*student, **options), lambda r: answer_here(exercise, r))
            except NotImplementedError:
                _record(exercise, "failed")
                raise
            passed(exercise, detail)

        in_this_process.exercise = exercise
        in_this_process.steps = steps
        in_this_process.hidden = hidden
        return in_this_process
    return wrap


def reseeded(rng):
    """The hidden settings of a check whose cases come from ``random.Random(seed)``: another
    seed, so that a table of the visible cases' answers does not cover them."""
    return {"seed": rng.randrange(2**31)}


def drive(generator, answer):
    """Run a check's generator to its end, answering each request with ``answer(request)``
    (an exception it raises is thrown into the generator); returns the pass detail."""
    value, error = None, None
    while True:
        try:
            request = generator.send(value) if error is None else generator.throw(error)
        except StopIteration as done:
            return done.value or ""
        try:
            value, error = answer(request), None
        except (CheckFailed, NotImplementedError) as exc:
            value, error = None, exc


_references_lock = threading.Lock()
_references_cache: dict = {}


def reference_ranks(fn, *args, nproc, timeout=120.0, **kwargs):
    """What ``fn(*args, **kwargs)`` returns on each of ``nproc`` gloo ranks of this
    process's own job, as plain data: for a reference that needs real ranks (a torch
    built-in on a process group). In the gradebook this process is the judge, whose
    jobs never run student code; answers are kept, so a class pays for each once."""
    from course_lib.grading import salt
    from course_lib.runtime.launcher import run

    fn = salt.carry(fn)  # a hidden run: the reference's seeds are mixed as the student's are
    key = cloudpickle.dumps((fn, args, kwargs, nproc))
    with _references_lock:
        if key not in _references_cache:
            _references_cache[key] = plain.encode(list(run(fn, *args, nproc=nproc,
                                                           backend="gloo", timeout=timeout,
                                                           **kwargs)))
        return plain.decode(_references_cache[key])


def answer_here(exercise, request):
    """Run ``request`` in this process (a notebook kernel) and read its answer."""
    from course_lib.grading import salt

    kept = {}
    request = salt.carried(request)
    return interpret(exercise, request, execute(request, kept), kept)


def launch(exercise, fn, *args, nproc, timeout=60.0, fresh=False, **kwargs):
    """``run(fn, ...)`` on CPU ranks with failures translated into messages about
    ``exercise`` (and recorded for :func:`ready`): what :func:`~course_lib.grading.
    requests.on_ranks` does, for any function (a test's, a notebook's)."""
    _record(exercise, "checking")
    if any(is_stub(obj) for obj in (fn, *args, *kwargs.values())):
        _record(exercise, "failed")  # no job: every rank would raise at its first line
        raise NotImplementedError(_not_implemented(exercise))
    _refuse_references(exercise, [fn, *args, *kwargs.values()])
    request = Request("ranks", fn, args, kwargs, nproc, float(timeout), fresh=fresh)
    try:
        return answer_here(exercise, request)
    except NotImplementedError:
        _record(exercise, "failed")
        raise


def answer_value(exercise, call, answer):
    """The value of one of ``call_each``'s answers, or a failure saying that ``call`` (how
    the call reads in a message) raised."""
    if "raised" in answer:
        raise CheckFailed(f"{exercise}: {call} raised {answer['raised']}: {answer['message']}")
    return answer["value"]


def _describe(tensor, limit=8):
    if not isinstance(tensor, torch.Tensor):
        return repr(tensor)
    flat = tensor.flatten()
    shown = flat[:limit].tolist()
    more = f" ... ({flat.numel()} elements)" if flat.numel() > limit else ""
    return f"{shown}{more} shape={tuple(tensor.shape)} dtype={tensor.dtype}"


def expect_close(exercise, got, expected, *, rank, world_size, what="result", hint="",
                 rtol=None, atol=None):
    """Raise CheckFailed unless tensor ``got`` equals ``expected`` (exactly for
    integers; to ``rtol``/``atol``, default torch's per-dtype tolerances, for floats)."""
    where = f"{exercise}: rank {rank} of world size {world_size}, {what}"
    hint = f"\nHint: {hint}" if hint else ""
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{where}: expected a tensor, got {type(got).__name__} ({got!r}).{hint}",
                          exercise=exercise)
    if got.shape != expected.shape:
        raise CheckFailed(f"{where}: expected shape {tuple(expected.shape)}, "
                          f"got {tuple(got.shape)}.{hint}", exercise=exercise)
    if got.dtype != expected.dtype:
        raise CheckFailed(f"{where}: expected dtype {expected.dtype}, got {got.dtype}.{hint}",
                          exercise=exercise)
    try:
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    except AssertionError as exc:
        first = _first_failing(got, expected, rtol, atol)
        raise CheckFailed(
            f"{where}: wrong values.\n  expected {_describe(expected)}\n  got      {_describe(got)}"
            f"\n  first difference at flat index {first}: expected "
            f"{expected.flatten()[first].item()!r}, got {got.flatten()[first].item()!r}"
            f"\n  ({str(exc).splitlines()[0]}){hint}", exercise=exercise) from None


# torch.testing.assert_close's defaults, (rtol, atol), for the dtypes the checks compare
_TOLERANCES = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
               torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7)}


def _first_failing(got, expected, rtol, atol):
    """The flat index of the first element outside the tolerance the comparison used (not
    merely the first that differs: a last-bit difference there would look like a pass)."""
    if not expected.is_floating_point():
        bad = (got != expected).flatten().nonzero()
        return int(bad[0]) if len(bad) else 0
    default_rtol, default_atol = _TOLERANCES.get(expected.dtype, (1e-7, 1e-7))
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    g, e = got.detach().double().flatten(), expected.detach().double().flatten()
    within = ((g - e).abs() <= atol + rtol * e.abs()) | (g == e)  # a NaN is outside
    bad = (~within).nonzero()
    return int(bad[0]) if len(bad) else 0


def expect_equal(exercise, got, expected, *, rank, world_size, what="value", hint=""):
    """Raise CheckFailed unless ``got == expected`` (counts, orders, plain values)."""
    if got != expected:
        hint = f"\nHint: {hint}" if hint else ""
        raise CheckFailed(f"{exercise}: rank {rank} of world size {world_size}, {what}: "
                          f"expected {expected!r}, got {got!r}.{hint}", exercise=exercise)


def passed(exercise, detail=""):
    """Announce a pass (the gradebook reads this line) and record it for :func:`ready`."""
    _record(exercise, "passed")
    print(f"{PASS_MARK} {exercise} passed" + (f" ({detail})" if detail else ""))
