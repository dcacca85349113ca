"""Lab 03's predictions, written once the FSDP unit is built and before the lab counts
its traffic: the bytes each rank sends per training step for P fp32 parameters on n
ranks under DDP, ZeRO-1 as Exercise 3.4 builds it (after DDP's all-reduce), ZeRO-1 as
the ZeRO paper and Lab 06's planner have it (a reduce-scatter), and FSDP with full
sharding or SHARD_GRAD_OP (Prediction 3.1). Graded against the ring's counts
(:mod:`course_lib.grading.predictions`)."""
from __future__ import annotations

from course_lib.grading.predictions import prediction_check

# passes of (n-1)/n of the 4P bytes a rank's ring sends per step: one for an all-gather
# or a reduce-scatter, two for an all-reduce
PASSES = {"ddp": 2, "zero1_all_reduce": 3, "zero1_reduce_scatter": 2, "fsdp_full": 3,
          "fsdp_grad_op": 2}
BYTES_CASES = [(s, 1_000_000, 4) for s in PASSES] + [
    ("fsdp_full", 300_000, 3), ("zero1_all_reduce", 300_000, 2), ("ddp", 300_000, 8),
    ("zero1_reduce_scatter", 300_000, 3), ("fsdp_full", 500_000, 1)]


def bytes_sent(strategy, p, n):
    """What each rank sends per step: ``PASSES[strategy]`` x (n-1)/n of the 4P bytes."""
    return PASSES[strategy] * (n - 1) / n * 4 * p


def _one(strategy, fn):
    return lambda s, p, n: fn(p, n) if s == strategy and n > 1 else bytes_sent(s, p, n)


BYTES_WRONG = [
    (_one("zero1_all_reduce", lambda p, n: 2 * (n - 1) / n * 4 * p),
     "the step you wrote runs after DDP's all-reduce of the whole gradient: that, plus the "
     "all-gather of the updated shards, is three passes"),
    (_one("zero1_reduce_scatter", lambda p, n: 3 * (n - 1) / n * 4 * p),
     "a rank needs only its shard's gradient: a reduce-scatter (one pass) instead of the "
     "all-reduce (two), then the all-gather"),
    (_one("fsdp_full", lambda p, n: 2 * (n - 1) / n * 4 * p),
     "full sharding frees the parameters after forward: backward gathers them again, a "
     "second all-gather"),
    (_one("fsdp_grad_op", lambda p, n: 3 * (n - 1) / n * 4 * p),
     "SHARD_GRAD_OP keeps the gathered parameters from forward to backward: one all-gather"),
    (_one("ddp", lambda p, n: 2 * (n - 1) * 4 * p), "each ring step sends one chunk, P/n "
                                                    "of the gradient"),
    (lambda s, p, n: PASSES[s] * (n - 1) / n * p, "P parameters of fp32 are 4P bytes"),
]
def _draw_bytes(rng):
    return (rng.choice(sorted(PASSES)), rng.randint(1, 10**10), rng.randint(1, 16))


check_traffic_prediction = prediction_check(
    "Prediction 3.1", BYTES_CASES, bytes_sent,
    lambda s, p, n: f"{s} with P = {p:,} fp32 parameters on n = {n} ranks", BYTES_WRONG,
    hint="list the collectives of one step and what a ring sends for each: (n-1)/n of the "
         "array for an all-gather or a reduce-scatter, 2(n-1)/n for an all-reduce",
    draw=_draw_bytes,
    detail=f"{len(BYTES_CASES)} settings, five strategies")
