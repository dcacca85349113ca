"""Graded predictions (``Prediction N.M``): the student writes, before a cell measures
it, what a quantity will be as a function of the setting, e.g. the bytes each rank
sends in an all-reduce of N bytes on K ranks. The check calls that function on many
settings in the student's process (:func:`predicted_numbers`) and compares each
number, in the judge, with the formula or the exact count (:func:`grade_numbers`),
never with a noisy timing. A wrong number is matched against the wrong formulas a
student is likely to have used, and the message says which mistake it is.

    check_bytes_prediction = prediction_check("Prediction 1.1", CASES, exact_bytes, describe,
                                              WRONG, detail="10 settings, K = 8 first")
    check_bytes_prediction(predicted_bytes_sent)      # in a notebook: ✓ Prediction 1.1 passed
"""
from __future__ import annotations

import math
import numbers

from course_lib.grading import checks
from course_lib.grading.requests import call_each, here


HIDDEN_CASES = 4  # settings the gradebook draws per prediction and submission


def round_sig(x, digits=2):
    """``x`` to ``digits`` significant figures: drawn settings that read like the lab's."""
    return float(f"{x:.{digits - 1}e}")


def log_uniform(rng, low, high, digits=2):
    """A number between ``low`` and ``high``, uniform in its exponent."""
    return round_sig(math.exp(rng.uniform(math.log(low), math.log(high))), digits)


def predicted_numbers(fn, cases):
    """On the student's side: ``fn(*case)`` for each case, as ``{"value": float}`` or
    ``{"raised": ..., "message": ...}`` (a result that is not a real number included)."""
    answers = call_each(fn, [(tuple(case), {}) for case in cases])
    for answer in answers:
        if "value" not in answer:
            continue
        value = answer.pop("value")
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if real or getattr(value, "ndim", None) == 0:  # a numpy or torch scalar too
            try:
                answer["value"] = float(value)
                continue
            except (TypeError, ValueError, RuntimeError):
                pass
        answer.update(raised="TypeError", message=f"returned {type(value).__name__}, "
                                                  f"not a number")
    return answers


def _show(x):
    """12,345 for a whole number, 0.0114800 as 0.01148."""
    return f"{round(x):,}" if x == round(x) and abs(x) < 1e15 else f"{x:.6g}"


def _close(got, want, rel):
    return math.isclose(got, want, rel_tol=rel, abs_tol=1e-12)


def _likely_mistake(case, got, answers, cases, wrong, rel):
    """The reason of the known wrong formula that gives ``got`` here and, of those, agrees
    with the student on the most settings (two can coincide on one setting)."""
    def agreement(known):
        return sum("value" in a and _close(a["value"], known(*c), rel)
                   for c, a in zip(cases, answers))

    matching = [(known, why) for known, why in wrong if _close(got, known(*case), rel)]
    return max(matching, key=lambda kw: agreement(kw[0]))[1] if matching else None


def grade_numbers(exercise, answers, cases, formula, describe, wrong=(), hint="", rel=1e-6,
                  also=()):
    """CheckFailed at the first case whose prediction is not ``formula(*case)``;
    ``wrong`` is ``[(formula, why)]``: the reason given when the prediction equals a
    known wrong formula there (:func:`_likely_mistake`). ``describe(*case)`` names the
    setting in a message. ``also``: formulas as right as ``formula`` (two first-order
    answers); the one the predictions agree with on the most cases is graded, on all."""
    formula = max((formula, *also), key=lambda known: sum(
        "value" in a and _close(a["value"], known(*c), rel) for c, a in zip(cases, answers)))
    for case, answer in zip(cases, answers):
        where = describe(*case)
        if "raised" in answer:
            raise checks.CheckFailed(f"{exercise}: for {where} your prediction raised "
                                     f"{answer['raised']}: {answer['message']}")
        got, want = answer["value"], formula(*case)
        if _close(got, want, rel):
            continue
        why = _likely_mistake(case, got, answers, cases, wrong, rel)
        raise checks.CheckFailed(
            f"{exercise}: for {where} you predicted {_show(got)}; it is {_show(want)}.\n"
            + (f"Why: {why}" if why else f"Hint: {hint}" if hint else "").rstrip())
    return len(cases)


def prediction_check(prediction, cases, formula, describe, wrong=(), hint="", detail="",
                     draw=None, also=()):
    """The check of ``prediction``: the student's function on every case, each number
    graded by :func:`grade_numbers` (``also``: other right formulas); its pass line says
    ``detail``. ``draw(rng)`` gives the gradebook's hidden cases
    (:func:`course_lib.grading.checks.check`)."""
    def hidden(rng):
        drawn = []
        for _ in range(HIDDEN_CASES):
            case = draw(rng)
            for _ in range(100):  # a small domain: redraw until it is not a visible case
                if case not in cases and case not in drawn:
                    break
                case = draw(rng)
            drawn.append(case)
        return {"cases": drawn}

    @checks.check(prediction, hidden=hidden if draw else None)
    def check(predicted, cases=cases):
        answers = yield here(predicted_numbers, predicted, cases)
        grade_numbers(prediction, answers, cases, formula, describe, wrong, hint, also=also)
        return detail or f"{len(cases)} settings"

    return check
