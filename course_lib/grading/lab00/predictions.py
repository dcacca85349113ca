"""Lab 00's predictions: the message size at which half of a message's time is latency,
n_1/2 = alpha B (Prediction 0.1), and the share of a step a rank spends computing when
every step ends in a ring shift and ranks compute for different times (Prediction
0.2): the slowest rank sets the pace. Graded on many settings against the exact values
(:mod:`course_lib.grading.predictions`)."""
from __future__ import annotations

from course_lib.grading.predictions import log_uniform, prediction_check

HALF_CASES = [(20e-6, 10e9), (2e-6, 50e9), (1e-3, 1e8), (5e-6, 4e9)]
SHARE_CASES = [(10, 20), (20, 20), (5, 40), (30, 30), (12, 16)]


def half_size(alpha, bandwidth):
    """The n at which alpha = n / B."""
    return alpha * bandwidth


def compute_share(my_ms, slowest_ms):
    """Every step waits for the slowest rank: this rank computes my/slowest of it."""
    return my_ms / slowest_ms


HALF_WRONG = [
    (lambda a, b: a / b, "seconds over bytes per second is not a size: alpha times B is"),
    (lambda a, b: b / a, "that is not in bytes: the size where alpha = n / B is n = alpha B"),
    (lambda a, b: 2 * a * b, "at n = alpha B the two terms are equal, each half of the time"),
    (lambda a, b: a * b / 2, "at n = alpha B the two terms are equal, each half of the time; "
                             "at alpha B / 2 latency is two thirds"),
]
SHARE_WRONG = [
    (lambda mine, slowest: 1, "a rank that finishes early waits in the shift for the slowest "
                              "rank: it is not computing then"),
    (lambda mine, slowest: mine / (mine + slowest), "a step lasts as long as the slowest "
                                                    "rank's compute, not the sum of both"),
    (lambda mine, slowest: (slowest - mine) / slowest, "that is the share spent waiting"),
]

def _draw_half(rng):
    return (log_uniform(rng, 1e-6, 1e-3), log_uniform(rng, 1e8, 5e11))


check_half_size_prediction = prediction_check(
    "Prediction 0.1", HALF_CASES, half_size,
    lambda a, b: f"alpha = {a * 1e6:g} us, B = {b / 1e9:g} GB/s", HALF_WRONG,
    hint="set the two terms of alpha + n/B equal and solve for n",
    draw=_draw_half,
    detail=f"{len(HALF_CASES)} (alpha, B), in bytes")

def _draw_share(rng):
    slowest = rng.randint(2, 90)
    return (rng.randint(1, slowest), slowest)


check_compute_share_prediction = prediction_check(
    "Prediction 0.2", SHARE_CASES, compute_share,
    lambda mine, slowest: f"a rank computing {mine} ms per step, the slowest {slowest} ms",
    SHARE_WRONG, hint="how long does one step last, for every rank?",
    draw=_draw_share,
    detail=f"{len(SHARE_CASES)} settings, the slowest rank included")
