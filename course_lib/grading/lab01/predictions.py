"""Lab 01's predictions: the bytes each rank sends (Prediction 1.1) and the time of a
ring all-reduce under the alpha-beta model (Prediction 1.2), written before the lab
measures both. Graded on many settings against the exact count and the model
(:mod:`course_lib.grading.predictions`); a wrong number is matched with the likely
mistake."""
from __future__ import annotations

from course_lib.collectives.cost_model import all_reduce_bytes_sent as bytes_sent
from course_lib.collectives.cost_model import ring_all_reduce_time
from course_lib.grading.predictions import log_uniform, prediction_check

# N in bytes of float32 whose element count every K here divides: the ring's chunks are
# exact, so the count is exactly 2(K-1)N/K (the lab's measurement shows the padding else)
_N = (4 * 120 * 1000, 4 * 120 * 7, 480)
BYTES_CASES = [("naive", _N[0], 8, 0), ("naive", _N[0], 8, 3), ("ring", _N[0], 8, 5),
               ("ring", _N[1], 3, 0), ("naive", _N[1], 3, 2), ("ring", _N[2], 2, 1),
               ("naive", _N[2], 5, 0), ("ring", _N[0], 5, 4), ("naive", _N[1], 1, 0),
               ("ring", _N[1], 1, 0)]
TIME_CASES = [(64e6, 8, 20e-6, 10e9), (1e3, 8, 20e-6, 10e9), (4e6, 3, 5e-6, 25e9),
              (1e9, 1024, 2e-6, 50e9), (5e5, 2, 1e-5, 1e10), (8e6, 1, 1e-5, 1e10)]


def _root(fn):
    """A wrong formula for rank 0 of the naive algorithm, the right count elsewhere."""
    return lambda a, n, k, r: fn(n, k) if a == "naive" and r == 0 and k > 1 \
        else bytes_sent(a, n, k, r)


def _others(fn):
    return lambda a, n, k, r: fn(n, k) if a == "naive" and r != 0 and k > 1 \
        else bytes_sent(a, n, k, r)


def _ring(fn):
    return lambda a, n, k, r: fn(n, k) if a == "ring" and k > 1 else bytes_sent(a, n, k, r)


BYTES_WRONG = [
    (_root(lambda n, k: n), "rank 0 sends the finished result to each of the K-1 others: "
                            "(K-1)N bytes, not N"),
    (_root(lambda n, k: 2 * (k - 1) * n), "that counts what rank 0 receives as well; it "
                                          "sends (K-1)N and receives as much"),
    (_others(lambda n, k: (k - 1) * n), "only rank 0 talks to everyone: every other rank "
                                        "sends its buffer once, to rank 0"),
    (_others(lambda n, k: 2 * n), "a rank other than 0 sends its buffer once and receives "
                                  "the result: N sent"),
    (_ring(lambda n, k: (k - 1) * n / k), "that is the reduce-scatter alone; the all-gather "
                                          "sends K-1 more chunks"),
    (_ring(lambda n, k: 2 * (k - 1) * n), "each step sends one chunk of N/K bytes, not the "
                                          "whole buffer"),
    (_ring(lambda n, k: 2 * n), "2N is the limit for many ranks; it is 2(K-1) chunks of N/K"),
    (_ring(lambda n, k: (k - 1) * n), "2(K-1) steps of one chunk, N/K bytes each"),
]

TIME_WRONG = [
    (lambda n, k, a, b: (k - 1) * (a + n / (k * b)),
     "that is one phase; the all-gather's K-1 steps follow the reduce-scatter's"),
    (lambda n, k, a, b: 2 * (k - 1) * (a + n / b),
     "each step moves one chunk of N/K bytes, not the whole buffer (that is the naive "
     "root's time)"),
    (lambda n, k, a, b: 2 * (k - 1) * a + 2 * n / b,
     "the bandwidth term is 2(K-1)/K x N/B; 2N/B is only its limit for many ranks"),
    (lambda n, k, a, b: a + 2 * (k - 1) * n / (k * b),
     "every step is a message of its own and pays alpha: 2(K-1) alphas"),
    (lambda n, k, a, b: 2 * k * (a + n / (k * b)),
     "a phase takes K-1 steps, not K: after K-1 hops a chunk has visited every rank"),
]


def _draw_bytes(rng):
    k = rng.randint(1, 9)  # N a multiple of 4K, as above: the ring's chunks are exact
    return (rng.choice(("naive", "ring")), 4 * k * rng.randint(1, 250_000), k, rng.randrange(k))


check_bytes_prediction = prediction_check(
    "Prediction 1.1", BYTES_CASES, bytes_sent,
    lambda a, n, k, r: f"rank {r} of the {a} all-reduce of N = {n:,} bytes on K = {k} ranks",
    BYTES_WRONG, hint="count the messages the rank sends and the bytes in each",
    draw=_draw_bytes,
    detail=f"{len(BYTES_CASES)} settings, K = 8 first, the naive root and the ring")

def _draw_time(rng):
    return (log_uniform(rng, 1e3, 1e9), rng.randint(1, 512), log_uniform(rng, 1e-6, 1e-4),
            log_uniform(rng, 1e9, 5e11))


check_ring_time_prediction = prediction_check(
    "Prediction 1.2", TIME_CASES, ring_all_reduce_time,
    lambda n, k, a, b: f"N = {n:,.0f} bytes, K = {k}, alpha = {a * 1e6:g} us, B = {b / 1e9:g} GB/s",
    TIME_WRONG, hint="count the steps (each costs alpha plus its bytes over B) and the bytes "
                     "in each step",
    draw=_draw_time,
    detail=f"{len(TIME_CASES)} settings, K = 1 to 1024, against 2(K-1)(alpha + N/(KB))")
