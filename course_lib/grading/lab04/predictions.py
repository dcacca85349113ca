"""Lab 04's predictions, written before the lab derives and measures them: the bubble
of GPipe with p balanced stages and m microbatches (Prediction 4.1), and how many
microbatches' activations a stage holds at its peak under GPipe and 1F1B (Prediction
4.2). Graded on many (p, m) against the exact values
(:mod:`course_lib.grading.predictions`), a wrong number matched with its likely
mistake."""
from __future__ import annotations

from course_lib.grading.predictions import prediction_check
from course_lib.pipeline import bubble_fraction

BUBBLE_CASES = [(4, 6), (2, 1), (4, 16), (8, 3), (3, 12), (1, 5)]
IN_FLIGHT_CASES = [("1f1b", 4, 8, 0), ("1f1b", 4, 8, 3), ("1f1b", 4, 8, 1), ("gpipe", 4, 8, 2),
                   ("1f1b", 5, 2, 0), ("1f1b", 5, 2, 4), ("gpipe", 3, 1, 0), ("1f1b", 1, 6, 0)]

BUBBLE_WRONG = [
    (lambda p, m: (p - 1) / m, "that is idle time over busy time; the bubble is the idle "
                               "share of the whole step, busy and idle together"),
    (lambda p, m: (p - 1) / (m + p), "the step is m + p - 1 slots long: m for the work, p - 1 "
                                     "to fill (and drain) the pipeline"),
    (lambda p, m: (p - 1) / p, "that is naive model parallelism, m = 1: microbatches keep "
                               "the stages busy at once"),
    (lambda p, m: 1 / m, "the fill takes p - 1 slots, not one: the last stage starts after "
                         "p - 1 forwards"),
]


def in_flight(schedule, p, m, stage):
    """Microbatches whose activations ``stage`` holds at its peak."""
    return m if schedule == "gpipe" else min(m, p - stage)


def _when_1f1b(fn):
    return lambda k, p, m, s: fn(p, m, s) if k == "1f1b" else in_flight(k, p, m, s)


IN_FLIGHT_WRONG = [
    (_when_1f1b(lambda p, m, s: p - s), "a stage cannot hold more microbatches than the step "
                                        "has: min(m, p - s)"),
    (_when_1f1b(lambda p, m, s: min(m, p - s - 1)), "that is the warm-up alone; the steady "
                                                    "phase's first forward comes before the "
                                                    "first backward"),
    (_when_1f1b(lambda p, m, s: min(m, s + 1)), "stage 0 warms up the most, not the last "
                                                "stage: count from the first"),
    (_when_1f1b(lambda p, m, s: min(m, p)), "the last stage alternates from the start: it "
                                            "holds one microbatch, stage s holds p - s"),
    (lambda k, p, m, s: min(m, p - s) if k == "gpipe" else in_flight(k, p, m, s),
     "GPipe runs every forward before any backward: all m microbatches are held"),
]


def _draw_bubble(rng):
    return (rng.randint(1, 16), rng.randint(1, 64))


check_bubble_prediction = prediction_check(
    "Prediction 4.1", BUBBLE_CASES, bubble_fraction, lambda p, m: f"p = {p}, m = {m}",
    BUBBLE_WRONG, hint="draw the schedule for p = 2, m = 2 and count the idle slots",
    draw=_draw_bubble,
    detail=f"{len(BUBBLE_CASES)} (p, m), p = 4 and m = 6 first")

def _draw_in_flight(rng):
    p = rng.randint(1, 9)
    return (rng.choice(("gpipe", "1f1b")), p, rng.randint(1, 16), rng.randrange(p))


check_in_flight_prediction = prediction_check(
    "Prediction 4.2", IN_FLIGHT_CASES, in_flight,
    lambda k, p, m, s: f"stage {s} of {k} with p = {p}, m = {m}", IN_FLIGHT_WRONG,
    hint="follow one stage: how many forwards has it run when its first backward starts?",
    draw=_draw_in_flight,
    detail=f"{len(IN_FLIGHT_CASES)} (schedule, p, m, stage), m < p included")
