"""Lab 07's predictions, written before the lab measures them: the bytes one rank sends
in one layer's forward pass under context, tensor (with sequence) and expert
parallelism (Prediction 7.2, :func:`course_lib.cp.traffic.layer_bytes_sent`), and the
activation memory one context-parallel attention layer keeps per rank
(Prediction 7.1, :func:`course_lib.cp.memory.activation_bytes`). Graded against the
formulas on many settings (:mod:`course_lib.grading.predictions`); the lab then shows
the counters and the measured bytes beside them."""
from __future__ import annotations

from course_lib.cp.memory import activation_bytes
from course_lib.cp.traffic import layer_bytes_sent
from course_lib.grading.predictions import prediction_check

FP32 = 4

TRAFFIC_CASES = [("cp", 1, 4096, 1024, 4, 2), ("tp_sp", 1, 4096, 1024, 4, 2),
                 ("ep", 1, 4096, 1024, 4, 2), ("cp", 2, 1536, 768, 3, 1),
                 ("tp_sp", 2, 1536, 768, 3, 1), ("ep", 2, 1536, 768, 3, 1),
                 ("cp", 4, 8192, 512, 8, 2), ("tp_sp", 4, 8192, 512, 8, 2),
                 ("ep", 4, 8192, 512, 8, 4), ("ep", 1, 4096, 1024, 2, 1)]


def traffic(split, b, s, h, n, k):
    return layer_bytes_sent(split, b, s, h, n, top_k=k, element_size=FP32)


def _only(split, formula, otherwise=traffic):
    """A wrong formula for ``split``, the right one elsewhere (so that the reason names
    the split the student got wrong)."""
    return lambda sp, *a: formula(*a) if sp == split else otherwise(sp, *a)


TRAFFIC_WRONG = [
    (_only("cp", lambda b, s, h, n, k: (n - 1) * b * s * h / n * FP32),
     "ring attention passes k AND v: two blocks of b (s/n) h at each of the n - 1 steps"),
    (_only("cp", lambda b, s, h, n, k: 2 * n * b * s * h / n * FP32),
     "after n - 1 steps every rank has seen every block: nothing is sent at the last step"),
    (_only("cp", lambda b, s, h, n, k: 2 * (n - 1) * b * s * h * FP32),
     "each rank holds s/n of the tokens: its k/v block is b (s/n) h, not b s h"),
    (_only("tp_sp", lambda b, s, h, n, k: 2 * (n - 1) / n * b * s * h / n * FP32),
     "the all-gather and reduce-scatter each move (n-1)/n of the WHOLE b s h activation "
     "per rank on a ring, not of the rank's s/n share"),
    (_only("tp_sp", lambda b, s, h, n, k: 4 * (n - 1) / n * b * s * h * FP32),
     "sequence parallelism replaces each all-reduce (2(n-1)/n) by an all-gather or a "
     "reduce-scatter ((n-1)/n each): the same bytes as before, not twice"),
    (_only("tp_sp", lambda b, s, h, n, k: (n - 1) / n * b * s * h * FP32),
     "the attention layer has both: an all-gather before q/k/v and a reduce-scatter after "
     "the output projection"),
    (_only("ep", lambda b, s, h, n, k: k * (n - 1) / n * (b * s / n) * h * FP32),
     "the tokens go out to their experts (dispatch) AND come back (combine)"),
    (_only("ep", lambda b, s, h, n, k: 2 * (n - 1) / n * (b * s / n) * h * FP32),
     "with top-k routing each token goes to k experts: k copies of its row"),
    (_only("ep", lambda b, s, h, n, k: 2 * k * (b * s / n) * h * FP32),
     "a token whose expert lives on its own rank stays there: only (n-1)/n of the rows "
     "leave"),
    (_only("ep", lambda b, s, h, n, k: 2 * k * (n - 1) / n * b * s * h * FP32),
     "each rank feeds the layer its b s / n tokens, not the whole batch"),
    (lambda sp, b, s, h, n, k: traffic(sp, b, s, h, n, k) / FP32,
     "in bytes: an fp32 element is 4 bytes"),
]


def _describe_traffic(split, b, s, h, n, k):
    name = {"cp": "CP (ring attention)", "tp_sp": "TP + SP (the attention layer)",
            "ep": f"EP (an MoE layer, top-{k})"}[split]
    return f"{name}, b = {b}, s = {s}, h = {h}, n = {n}"


def _draw_traffic(rng):
    n = rng.randint(2, 8)
    return (rng.choice(("cp", "tp_sp", "ep")), rng.randint(1, 8), 2 * n * rng.randint(1, 1024),
            64 * rng.randint(1, 64), n, rng.randint(1, 4))


check_traffic_prediction = prediction_check(
    "Prediction 7.2", TRAFFIC_CASES, traffic, _describe_traffic, TRAFFIC_WRONG,
    hint="count the messages of one forward pass on one rank, and the elements in each",
    draw=_draw_traffic,
    detail=f"{len(TRAFFIC_CASES)} settings, the three splits, n = 2 to 8")

MEMORY_CASES = [(1, 16384, 1024, 16, 1), (1, 16384, 1024, 16, 2), (1, 16384, 1024, 16, 4),
                (2, 6144, 768, 12, 3), (4, 32768, 4096, 32, 8), (1, 1000, 64, 4, 2)]


def activation(b, s, h, heads, cp):
    return activation_bytes(b, s, h, heads, cp, element_size=FP32)


MEMORY_WRONG = [
    (lambda b, s, h, heads, cp: activation(b, s, h, heads, 1),
     "each rank keeps only its own s/cp tokens' tensors: the memory falls as 1/cp"),
    (lambda b, s, h, heads, cp: activation(b, s, h, heads, cp) + b * heads * s * s / cp * FP32,
     "ring attention never keeps a score matrix: backward recomputes each block's "
     "scores from q, k and the log-sum-exp"),
    (lambda b, s, h, heads, cp: b * heads * s * s / cp * FP32,
     "no s x s matrix is kept: backward recomputes the scores block by block"),
    (lambda b, s, h, heads, cp: 6 * b * s * h / cp * FP32,
     "the log-sum-exp is kept too: one number per query and head"),
    (lambda b, s, h, heads, cp: 4 * b * s * h / cp * FP32 + b * heads * s / cp * FP32,
     "the two linear layers keep their inputs as well: x for the q/k/v projection and the "
     "attention's output, reshaped, for the output projection"),
    (lambda b, s, h, heads, cp: activation(b, s, h, heads, cp) / FP32,
     "in bytes: an fp32 element is 4 bytes"),
]

def _draw_memory(rng):
    heads, cp = rng.randint(1, 32), rng.randint(1, 8)
    return (rng.randint(1, 8), cp * rng.randint(1, 8192), heads * rng.choice((32, 64, 128)),
            heads, cp)


check_activation_prediction = prediction_check(
    "Prediction 7.1", MEMORY_CASES, activation,
    lambda b, s, h, heads, cp: f"b = {b}, s = {s}, h = {h}, {heads} heads, cp = {cp}",
    MEMORY_WRONG, hint="list what the layer keeps for backward, tensor by tensor, and the "
                       "shape of each on one rank",
    draw=_draw_memory,
    detail=f"{len(MEMORY_CASES)} settings, cp = 1 to 8")
