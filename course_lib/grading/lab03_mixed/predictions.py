"""Prediction 3.2, written before Lab 03 measures it: the bytes of model state (weights,
gradients, AdamW's moments, a master copy) that P parameters take after a training step
under each mixed-precision recipe of :mod:`course_lib.memory.precision`. Graded against
that table, a wrong number matched with its likely mistake."""
from __future__ import annotations

from course_lib.grading.predictions import prediction_check
from course_lib.memory.precision import RECIPES, state_bytes_per_param

STATE_CASES = [(r, 1_000_000) for r in RECIPES] + [
    ("autocast_bf16", 7_000_000_000), ("pure_bf16", 123_457), ("bf16_master", 3), ("fp32", 1)]


def state_bytes(recipe, p):
    return state_bytes_per_param(recipe) * p


def _one(recipe, per_param):
    return lambda r, p: per_param * p if r == recipe else state_bytes(r, p)


STATE_WRONG = [
    (_one("autocast_bf16", 8), "autocast casts copies for the matmuls and frees them; the "
                               "weights, their gradients and both moments stay fp32"),
    (_one("autocast_bf16", 12), "autocast keeps no bf16 weights: the fp32 parameters are the "
                                "ones the optimizer steps, 4 + 4 + 8"),
    (_one("bf16_master", 14), "the lecture notes' 14P leaves out the bf16 gradient: 2 + 2 + "
                              "4 + 4 + 4"),
    (_one("bf16_master", 12), "the fp32 master copy of every weight is state too, 4 bytes"),
    (_one("pure_bf16", 12), "with no fp32 anywhere Adam's two moments are bf16 as well: "
                            "2 + 2 + 2 + 2"),
    (_one("fp32", 12), "the gradient of an fp32 weight is fp32: 4 + 4 + 8"),
    (_one("fp32", 8), "AdamW keeps two moments per parameter, m and v"),
    (lambda r, p: state_bytes_per_param(r), "that is per parameter: the model has P of them"),
    (lambda r, p: 8 * state_bytes(r, p), "bytes, not bits"),
]
def _draw_state(rng):
    return (rng.choice(sorted(RECIPES)), rng.randint(1, 10**10))


check_state_prediction = prediction_check(
    "Prediction 3.2", STATE_CASES, state_bytes,
    lambda r, p: f"the {r} recipe with P = {p:,} parameters", STATE_WRONG,
    hint="list what a parameter keeps between steps (weight, gradient, m, v, a master "
         "copy?) and the dtype of each",
    draw=_draw_state,
    detail=f"{len(STATE_CASES)} settings, four recipes")
