"""Lab 06's predictions. Before the strategy table counts it: the bytes stage s of a
DP x PP pipeline sends to its neighbours in one step (Prediction 6.1). Before the
planner lists its meshes: the model state one GPU of a mesh (dp, tp, pp) holds,
with ZeRO stage z over dp (Prediction 6.2). Both graded against the exact count
on many settings, uneven ones included (:mod:`course_lib.grading.predictions`).

Notation: p stages, m microbatches, B sequences of T tokens of width D, split over
dp replicas; P parameters, n = dp tp pp GPUs.
"""
from __future__ import annotations

from course_lib.grading.predictions import prediction_check

FP32 = 4  # bytes per element of the course GPT's activations and their gradients

# (stage, p, B, dp, m, T, D): the lab's setting first; a middle stage; m that does not
# divide a replica's rows (6 rows in 4 microbatches, 3 in 2); a single stage
P2P_CASES = [(0, 2, 8, 2, 2, 16, 32), (1, 2, 8, 2, 2, 16, 32), (1, 3, 12, 2, 4, 16, 32),
             (2, 3, 12, 2, 4, 16, 32), (0, 3, 9, 3, 2, 8, 24), (2, 4, 32, 4, 8, 64, 128),
             (0, 1, 8, 2, 2, 16, 32)]


def directions(stage, p):
    """Activations forward unless ``stage`` is the last; gradients back unless it is the first."""
    return (stage < p - 1) + (stage > 0)


def p2p_bytes(stage, p, batch, dp, m, seq_len, dim):
    """Bytes ``stage`` sends in one step, the shape header aside: its replica's B/dp rows
    of (T, D) fp32, once per direction. The m microbatches cut those rows, so m cancels."""
    return directions(stage, p) * batch // dp * seq_len * dim * FP32


P2P_WRONG = [
    (lambda s, p, b, dp, m, t, d: (s < p - 1) * b // dp * t * d * FP32,
     "backward sends too: every stage but the first sends the gradient of the activation it "
     "received back, as large as that activation"),
    (lambda s, p, b, dp, m, t, d: 2 * (p > 1) * b // dp * t * d * FP32,
     "the end stages send one way only: stage 0 has nobody to send a gradient to, and the "
     "last stage nobody to send an activation to"),
    (lambda s, p, b, dp, m, t, d: directions(s, p) * b * t * d * FP32,
     "a pipeline carries only its replica's B/dp rows; the other replicas run pipelines of "
     "their own"),
    (lambda s, p, b, dp, m, t, d: directions(s, p) * m * b // dp * t * d * FP32,
     "a message carries one microbatch, 1/m of the replica's rows: the m messages together "
     "carry B/dp rows, whatever m"),
    (lambda s, p, b, dp, m, t, d: directions(s, p) * b / dp / m * t * d * FP32,
     "every microbatch crosses the stage's edges, not one: m messages each way"),
    (lambda s, p, b, dp, m, t, d: directions(s, p) * b // dp * t * d,
     "those are elements; the activations and their gradients are fp32, 4 bytes each"),
]

# (P, dp, tp, pp, z): OLMo 70B on the mesh the heading asks about first, OLMo 7B, then
# dp, tp and pp of 3 and 5 with P that does not divide by them, and dp = 1 (no sharding)
STATE_CASES = [(65_288_471_656, 4, 4, 8, 1), (6_715_153_764, 32, 1, 1, 0),
               (6_715_153_764, 16, 1, 2, 2), (1_000_000, 3, 1, 1, 1), (1_000_003, 2, 3, 1, 3),
               (1_000_000, 1, 2, 2, 1), (1_176_000_000, 8, 2, 3, 2), (5_000_000, 5, 1, 3, 3)]
MIXED = (2, 2, 12)  # bf16 weight, bf16 gradient, fp32 master copy + Adam's m and v
FULL_FP32 = (4, 4, 8)  # fp32 weight and gradient, Adam's m and v


def _zero_sharded(p, dp, z, sizes=MIXED):
    """Bytes of ``p`` parameters' state on one of dp replicas: ZeRO stage z shards the
    optimizer (z >= 1), the gradients (z >= 2) and the weights (z = 3) dp ways."""
    weight, grad, optimizer = sizes
    return p * (weight / (dp if z >= 3 else 1) + grad / (dp if z >= 2 else 1)
                + optimizer / (dp if z >= 1 else 1))


def state_bytes(p, dp, tp, pp, z):
    """Model state on one GPU: tp and pp give it P/(tp pp) parameters (the stages
    balanced), whose 16 bytes each ZeRO-z shards over the dp replicas that hold them."""
    return _zero_sharded(p / (tp * pp), dp, z)


STATE_WRONG = [
    (lambda p, dp, tp, pp, z: 16 * p / (tp * pp),
     "ZeRO shards over the dp replicas: stage 1 the optimizer state, stage 2 the gradients "
     "as well, stage 3 the weights as well"),
    (lambda p, dp, tp, pp, z: _zero_sharded(p / (tp * pp), dp * tp * pp, z),
     "ZeRO shards a parameter's state over the replicas that hold that parameter, dp ways: "
     "the tp and pp ranks of a replica hold different parameters already"),
    (lambda p, dp, tp, pp, z: 16 * p / (dp * tp * pp),
     "only ZeRO-3 splits everything n ways; below it each replica keeps whole bf16 weights "
     "(and below ZeRO-2 whole gradients)"),
    (lambda p, dp, tp, pp, z: _zero_sharded(p / (tp * pp), dp, z, FULL_FP32),
     "the planner trains in mixed precision: 2 bytes of bf16 weight and 2 of gradient, and "
     "12 of optimizer state (the fp32 master copy, m and v), which ZeRO-1 shards first"),
    (lambda p, dp, tp, pp, z: _zero_sharded(p / (tp * pp), dp, min(z + 1, 3)),
     "one stage too far: ZeRO-1 shards only the optimizer state, ZeRO-2 adds the gradients "
     "and ZeRO-3 the weights"),
]

def _draw_p2p(rng):
    p, dp = rng.randint(1, 6), rng.randint(1, 8)
    return (rng.randrange(p), p, dp * rng.randint(1, 16), dp, rng.randint(1, 8),
            rng.randint(1, 512), rng.randint(1, 1024))


check_p2p_bytes_prediction = prediction_check(
    "Prediction 6.1", P2P_CASES, p2p_bytes,
    lambda s, p, b, dp, m, t, d: f"stage {s} of p = {p}, B = {b} over dp = {dp}, m = {m}, "
                                 f"T = {t}, D = {d}",
    P2P_WRONG, hint="follow one microbatch through stage s: what does it receive and send in "
                    "forward, and in backward? Then add up the microbatches",
    draw=_draw_p2p,
    detail=f"{len(P2P_CASES)} settings, p = 1 to 4, m that does not divide the rows included")

def _draw_state(rng):
    return (rng.randint(10**6, 10**11), rng.randint(1, 64), rng.randint(1, 8),
            rng.randint(1, 16), rng.randint(0, 3))


check_state_bytes_prediction = prediction_check(
    "Prediction 6.2", STATE_CASES, state_bytes,
    lambda p, dp, tp, pp, z: f"P = {p:,} on dp = {dp}, tp = {tp}, pp = {pp} with ZeRO-{z}",
    STATE_WRONG, hint="split the 16 bytes of a parameter by what they hold, then ask which of "
                      "them each dim divides",
    draw=_draw_state,
    detail=f"{len(STATE_CASES)} meshes, ZeRO-0 to ZeRO-3, sizes of 3 and 5 included")
