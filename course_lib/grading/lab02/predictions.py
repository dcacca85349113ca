"""Lab 02's predictions, written before the lab counts them: the bytes one device sends
in a training step under DataParallel (GPU 0) and under DDP (each rank) (Prediction
2.1), and how large the gradient is after accumulating micro-batches, with and without
dividing each micro-batch's loss (Prediction 2.2). Graded on many settings against the
exact counts (:mod:`course_lib.grading.predictions`)."""
from __future__ import annotations

from course_lib.ddp.traffic import ddp_bytes_per_rank, dp_bytes_through_device0
from course_lib.grading.predictions import prediction_check

# (wrapper, P weights, B batch, O outputs, K), bytes; B and O split evenly over K
BYTES_CASES = [("dp", 4_000_000, 96_000, 48_000, 4), ("ddp", 4_000_000, 96_000, 48_000, 4),
               ("dp", 1_200_000, 24_000, 24_000, 2), ("ddp", 1_200_000, 24_000, 24_000, 3),
               ("dp", 800_000, 48_000, 12_000, 8), ("ddp", 800_000, 48_000, 12_000, 8),
               ("dp", 500_000, 1_000, 1_000, 1), ("ddp", 500_000, 1_000, 1_000, 1)]
RATIO_CASES = [(4, False), (4, True), (2, False), (8, True), (3, False), (1, False)]


def bytes_sent(wrapper, p, b, o, k):
    """What GPU 0 (DataParallel) or each rank (DDP, a ring all-reduce) sends per step."""
    return (dp_bytes_through_device0(p, b, o, k) if wrapper == "dp"
            else ddp_bytes_per_rank(p, k))["sent"]


def gradient_ratio(micro_batches, divide_by_m):
    """The accumulated gradient over the whole batch's (mean losses, equal pieces)."""
    return 1 if divide_by_m else micro_batches


def _only(wrapper, fn):
    """A wrong formula for ``wrapper`` (on more than one device), the right count else."""
    return lambda w, p, b, o, k: (fn(p, b, o, k) if w == wrapper and k > 1
                                  else bytes_sent(w, p, b, o, k))


def _dp(fn):
    return _only("dp", fn)


def _ddp(fn):
    return _only("ddp", fn)


BYTES_WRONG = [
    (_dp(lambda p, b, o, k: (k - 1) * p), "GPU 0 also sends the batch's slices at the start and "
                                          "each output slice's gradient in backward"),
    (_dp(lambda p, b, o, k: 2 * (k - 1) * p + (k - 1) / k * (b + o)),
     "the other GPUs' gradients come in to GPU 0: received, not sent"),
    (_dp(lambda p, b, o, k: k * p + b + o), "GPU 0 keeps its own copy and its own slice: "
                                            "K-1 copies of the weights, (K-1)/K of the batch"),
    (_dp(lambda p, b, o, k: (k - 1) * p + (k - 1) / k * b), "the gradient of each output "
                                                            "slice goes back out in backward"),
    (_ddp(lambda p, b, o, k: 2 * (k - 1) * p), "each ring step sends one chunk of P/K bytes, "
                                               "not the whole gradient"),
    (_ddp(lambda p, b, o, k: (k - 1) / k * p), "that is the reduce-scatter alone; the "
                                               "all-gather sends as much again"),
    (_ddp(lambda p, b, o, k: 2 * p), "2P is the limit for many ranks; it is 2(K-1)/K P"),
    (_ddp(lambda p, b, o, k: 2 * (k - 1) / k * p + (k - 1) / k * b),
     "under DDP no batch moves: each rank reads its own shard"),
]
RATIO_WRONG = [
    (lambda m, d: 1, "backward adds into .grad: the gradients of m micro-batch means add up "
                     "to m times the gradient of the whole batch's mean"),
    (lambda m, d: 1 / m if d else 1, "without dividing, the m means add up to m times the "
                                     "batch's; dividing each by m brings the sum back to 1"),
    (lambda m, d: m, "dividing each micro-batch's loss by m divides its gradient by m: the "
                     "sum is then the whole batch's"),
]

def _draw_bytes(rng):
    k = rng.randint(1, 8)  # B and O split evenly over K, as above
    return (rng.choice(("dp", "ddp")), 1000 * rng.randint(1, 9000), k * rng.randint(1, 20_000),
            k * rng.randint(1, 20_000), k)


check_bytes_per_step_prediction = prediction_check(
    "Prediction 2.1", BYTES_CASES, bytes_sent,
    lambda w, p, b, o, k: (f"{'GPU 0 under DP' if w == 'dp' else 'each rank under DDP'} with "
                           f"P = {p:,}, X = {b:,}, O = {o:,} bytes, K = {k}"),
    BYTES_WRONG, hint="follow every arrow of one step: what leaves the device, forward and "
                      "backward",
    draw=_draw_bytes,
    detail=f"{len(BYTES_CASES)} settings, DP's GPU 0 and a DDP rank, K = 1 to 8")

def _draw_ratio(rng):
    return (rng.randint(1, 16), rng.random() < 0.5)


check_gradient_ratio_prediction = prediction_check(
    "Prediction 2.2", RATIO_CASES, gradient_ratio,
    lambda m, d: f"m = {m} micro-batches{', each loss divided by m' if d else ''}", RATIO_WRONG,
    hint="what does a second backward do to a .grad that is already there?",
    draw=_draw_ratio,
    detail=f"{len(RATIO_CASES)} settings, with and without dividing")
