"""Lab 08's predictions, written before the lab measures them: the bytes one rank writes
when an FSDP model trained with Adam(W) is saved (Prediction 8.1: parameters and the
two moments, 12 P / n; the lab then lists the files' sizes), and the checkpoint interval
that maximises goodput (Prediction 8.2: Young's sqrt(2 C M) or Daly's sqrt(2 C M) - C,
:func:`course_lib.checkpoint.goodput.young_interval` and ``daly_interval``; the lab then
sweeps the simulated goodput). Graded against the formulas on many settings
(:mod:`course_lib.grading.predictions`).
"""
from __future__ import annotations

import math

from course_lib.grading.predictions import log_uniform, prediction_check

FP32 = 4

# (P, n): the lab's 4 ranks first. P / n >= 1e6 everywhere, so that a prediction that
# counts the step's 4 bytes on rank 0 is within the tolerance (1e-6) of 12 P / n
BYTES_CASES = [(7e9, 4), (1.3e8, 4), (1e6, 1), (1.3e8, 2), (7e9, 8), (3e8, 3), (1.24e8, 8),
               (2e7, 2), (7e10, 8), (3.6e7, 3)]


def saved_bytes(p, n):
    """Rank r's share of the fp32 parameters and Adam's two moments (m and v)."""
    return 3 * FP32 * p / n


BYTES_WRONG = [
    (lambda p, n: 16 * p / n,
     "gradients are not saved: the next step computes new ones. A resumed run needs the "
     "parameters and Adam's two moments, 3 x 4 bytes per parameter"),
    (lambda p, n: 4 * p / n,
     "the optimizer's state is saved too: without Adam's two moments (m and v, fp32, the "
     "shape of the parameters) a resumed run is not the run that stopped"),
    (lambda p, n: 8 * p / n,
     "three fp32 tensors of P elements are saved: the parameters AND both of Adam's moments "
     "(m and v)"),
    (lambda p, n: 12 * p,
     "each rank writes only its own shard, 1/n of every tensor: FSDP never gathers the "
     "whole model to save it"),
    (lambda p, n: 16 * p,
     "each rank writes only its own 1/n shard, and gradients are not saved: parameters and "
     "Adam's two moments, 12 bytes per parameter over n ranks"),
    (lambda p, n: 3 * p / n,
     "in bytes: an fp32 element is 4 bytes"),
]


def _describe_bytes(p, n):
    return f"P = {p:,.0f} parameters on n = {n} ranks"


def _draw_bytes(rng):
    n = rng.randint(1, 8)  # P / n >= 1e6, as above
    return (float(n * rng.randint(10**6, 10**10)), n)


check_bytes_prediction = prediction_check(
    "Prediction 8.1", BYTES_CASES, saved_bytes, _describe_bytes, BYTES_WRONG,
    hint="list the tensors a resumed run needs (gradients are not among them), their dtype, "
         "and the share of each that one FSDP rank holds; Adam's step count, one 4-byte "
         "scalar that rank 0 writes once, is negligible: leave it out",
    draw=_draw_bytes,
    detail=f"{len(BYTES_CASES)} settings, n = 1 to 8 (4 first), P = 1e6 to 7e10")

# (C, M) in seconds: Llama 3's MTBF (54 days, 419 unexpected interruptions) first
INTERVAL_CASES = [(60, 11135), (10, 1e5), (300, 86400), (1, 100), (30, 3600), (120, 7.2e5),
                  (5, 50), (600, 2.6e6)]


def best_interval(c, m):
    """Young's interval: the waste C / tau + tau / (2 M) is smallest at sqrt(2 C M)."""
    return math.sqrt(2 * c * m)


def daly_interval(c, m):
    """Daly's first-order interval: counting the write in the cycle, the waste
    C / (tau + C) + (tau + C) / (2 M) is smallest at sqrt(2 C M) - C. As right as Young's
    to first order, and nearer the exact optimum where C / M is not small (C = 5 s,
    M = 50 s: Young 22.4 s, Daly 17.4 s, the simulated process 19.2 s)."""
    return math.sqrt(2 * c * m) - c


INTERVAL_WRONG = [
    (lambda c, m: math.sqrt(c * m),
     "a failure loses on average HALF an interval of work, tau / 2: the waste is "
     "C / tau + tau / (2 M), smallest at tau = sqrt(2 C M)"),
    (lambda c, m: 2 * c * m,
     "the square root: the waste C / tau + tau / (2 M) has its minimum where "
     "C / tau^2 = 1 / (2 M), i.e. tau^2 = 2 C M"),
    (lambda c, m: c * m / 2,
     "set the derivative of the waste C / tau + tau / (2 M) to 0: C / tau^2 = 1 / (2 M), "
     "so tau = sqrt(2 C M), not C M / 2"),
    (lambda c, m: m / 2,
     "the interval depends on the checkpoint's cost C too: the more a checkpoint costs, the "
     "less often it pays to write one; tau = sqrt(2 C M)"),
    (lambda c, m: math.sqrt(2 * c / m),
     "a longer mean time between failures makes the best interval LONGER (fewer failures, "
     "less work lost per hour): tau = sqrt(2 C M), M multiplies"),
    (lambda c, m: m - c,
     "the waste C / tau + tau / (2 M) has its minimum at tau = sqrt(2 C M), well below M: "
     "checkpointing once per M s loses M / 2 of work at nearly every failure"),
]

def _draw_interval(rng):
    # M >= 10 C: where a checkpoint costs half the MTBF no interval pays (Daly's goes negative)
    c = rng.randint(1, 600)
    return (c, log_uniform(rng, max(100, 10 * c), 3e6))


check_interval_prediction = prediction_check(
    "Prediction 8.2", INTERVAL_CASES, best_interval,
    lambda c, m: f"C = {c:g} s, M = {m:g} s", INTERVAL_WRONG,
    hint="write the fraction of time wasted as a function of tau: C / (tau + C) writing, and "
         "per second 1 / M failures that each lose half a cycle, (tau + C) / 2, on average "
         "(or, as Young did, C / tau and tau / 2); then minimise it",
    draw=_draw_interval, also=(daly_interval,),
    detail=f"{len(INTERVAL_CASES)} settings, C = 1 s to 10 min, M = 50 s to a month "
           f"(Young's sqrt(2CM) or Daly's sqrt(2CM) - C)")
