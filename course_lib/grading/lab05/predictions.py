"""Lab 05's predictions, written before the lab counts them: how many all-reduces one
tensor-parallel transformer block makes in forward and in backward (Prediction 5.1),
and how many elements each carries (Prediction 5.2), for t >= 2 ranks. Graded against
Megatron's split (f and g around the attention and around the MLP) on many settings
(:mod:`course_lib.grading.predictions`)."""
from __future__ import annotations

from course_lib.grading.predictions import prediction_check

COUNT_CASES = [("forward", 2), ("backward", 2), ("forward", 8), ("backward", 3),
               ("backward", 8), ("forward", 4)]
SIZE_CASES = [(4, 128, 768, 2), (4, 128, 768, 8), (1, 4096, 8192, 4), (3, 16, 96, 3),
              (8, 512, 1024, 2)]


def all_reduces(direction, t):
    """g after the attention and after the MLP (forward); f before each (backward)."""
    return 2


def elements(b, s, h, t):
    """Each all-reduce sums a whole (b, s, h) activation, whatever t."""
    return b * s * h


_GROWS = "the count does not grow with t: one all-reduce sums all t partial results at once"
COUNT_WRONG = [
    (lambda d, t: 4, "one per linear layer is too many: a column-parallel layer needs nothing "
                     "in forward (f is the identity there) and a row-parallel one nothing in "
                     "backward (g's backward is the identity)"),
    (lambda d, t: 2 if d == "forward" else 0, "f's backward all-reduces the input gradient: "
                                              "each rank's slice of the weights gives only a "
                                              "part of it"),
    (lambda d, t: 1, "the attention and the MLP each end with their own g (and start with "
                     "their own f)"),
    (lambda d, t: 2 * (t - 1), _GROWS),
    (lambda d, t: 2 * t, _GROWS),
]
SIZE_WRONG = [
    (lambda b, s, h, t: b * s * h / t, "the activations do not shrink with t: g sums whole "
                                       "(b, s, h) partial outputs, one from each rank"),
    (lambda b, s, h, t: 4 * b * s * h, "the MLP's all-reduce comes after its row-parallel "
                                       "layer, whose output is h wide, not 4h"),
    (lambda b, s, h, t: b * s * h / t * (t - 1), "that is half of what a ring all-reduce "
                                                 "sends per rank (its reduce-scatter); the "
                                                 "all-reduce itself is on all b*s*h"),
    (lambda b, s, h, t: 2 * b * s * h / t * (t - 1), "that is what a ring all-reduce sends per "
                                                     "rank, not the size of the array it "
                                                     "reduces: b*s*h"),
    (lambda b, s, h, t: s * h, "the batch is not split by tensor parallelism: b*s*h"),
]

def _draw_count(rng):
    return (rng.choice(("forward", "backward")), rng.randint(2, 64))


check_all_reduce_count_prediction = prediction_check(
    "Prediction 5.1", COUNT_CASES, all_reduces, lambda d, t: f"the {d} pass of one block on "
                                                             f"t = {t} ranks",
    COUNT_WRONG, hint="where in the block does a rank hold only a part of a sum?",
    draw=_draw_count,
    detail=f"{len(COUNT_CASES)} settings, t = 2 to 8, forward and backward")

def _draw_size(rng):
    t = rng.randint(2, 16)
    return (rng.randint(1, 16), rng.randint(1, 8192), t * rng.randint(1, 1024), t)


check_all_reduce_size_prediction = prediction_check(
    "Prediction 5.2", SIZE_CASES, elements,
    lambda b, s, h, t: f"b = {b}, s = {s}, h = {h}, t = {t}", SIZE_WRONG,
    hint="what shape is the tensor g sums?",
    draw=_draw_size,
    detail=f"{len(SIZE_CASES)} shapes, t = 2 to 8")
