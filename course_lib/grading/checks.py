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
naming the exercise; a hang as :class:`CheckFailed` with every rank's stack.
"""
from __future__ import annotations

import torch

from course_lib.runtime.launcher import LaunchError, LaunchTimeout, run

PASS_MARK = "✓"


class CheckFailed(AssertionError):
    """The student's code ran but gave a wrong answer (or hung, or crashed)."""


def launch(exercise, fn, *args, nproc, timeout=60.0, backend="gloo", **kwargs):
    """``run(fn, ...)`` with failures translated into messages about ``exercise``.
    Checks grade on CPU ranks (gloo) by default: world sizes like 3 need no GPUs,
    and a grade does not depend on the machine."""
    try:
        return run(fn, *args, nproc=nproc, timeout=timeout, backend=backend, **kwargs)
    except LaunchTimeout as exc:
        raise CheckFailed(
            f"{exercise}: with world size {nproc} your code did not finish in {timeout:g}s. "
            f"Hint: look for a send or recv that no other rank matches (each send needs "
            f"the peer's recv, and two ranks that both wait to receive first deadlock).\n\n"
            f"{exc}") from None
    except LaunchError as exc:
        if exc.exc_type == "NotImplementedError":
            raise NotImplementedError(
                f"{exercise} is not implemented yet: replace the `raise NotImplementedError` "
                f"in its code cell with your solution, run that cell, then this one.") from None
        rank = exc.errors[0]["rank"] if exc.errors else "?"
        raise CheckFailed(f"{exercise}: your code raised on rank {rank} "
                          f"(world size {nproc}).\n\n{exc}") from None


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
        raise CheckFailed(f"{where}: expected a tensor, got {type(got).__name__} ({got!r}).{hint}")
    if got.shape != expected.shape:
        raise CheckFailed(f"{where}: expected shape {tuple(expected.shape)}, "
                          f"got {tuple(got.shape)}.{hint}")
    if got.dtype != expected.dtype:
        raise CheckFailed(f"{where}: expected dtype {expected.dtype}, got {got.dtype}.{hint}")
    try:
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    except AssertionError as exc:
        bad = (got != expected).flatten().nonzero()
        first = int(bad[0]) if len(bad) else 0
        raise CheckFailed(
            f"{where}: wrong values.\n  expected {_describe(expected)}\n  got      {_describe(got)}"
            f"\n  first difference at flat index {first}: expected "
            f"{expected.flatten()[first].item()!r}, got {got.flatten()[first].item()!r}"
            f"\n  ({str(exc).splitlines()[0]}){hint}") from None


def expect_equal(exercise, got, expected, *, rank, world_size, what="value", hint=""):
    """Raise CheckFailed unless ``got == expected`` (counts, orders, plain values)."""
    if got != expected:
        hint = f"\nHint: {hint}" if hint else ""
        raise CheckFailed(f"{exercise}: rank {rank} of world size {world_size}, {what}: "
                          f"expected {expected!r}, got {got!r}.{hint}")


def passed(exercise, detail=""):
    """Announce a pass; the gradebook reads this line."""
    print(f"{PASS_MARK} {exercise} passed" + (f" ({detail})" if detail else ""))
