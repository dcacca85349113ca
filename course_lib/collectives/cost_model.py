"""Alpha-beta (latency-bandwidth) cost models: one message of n bytes costs
alpha + n / B  (alpha: latency in s, B: bandwidth in bytes/s, beta = 1/B)."""
from __future__ import annotations

import numpy as np


def p2p_time(nbytes, alpha, bandwidth):
    """alpha + n/B for one message."""
    return alpha + np.asarray(nbytes, dtype=float) / bandwidth


def fit_alpha_beta(sizes_bytes, seconds):
    """Least-squares fit of t = alpha + beta * n; returns (alpha, B = 1/beta).
    Relative errors are what matter across six decades of n, so each point is
    weighted by 1/t (a plain fit would ignore every small message)."""
    n = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if n.shape != t.shape or len(n) < 2:
        raise ValueError("need at least two (size, time) pairs of equal length")
    w = 1.0 / t
    design = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if beta <= 0:
        raise ValueError("times do not grow with size: no bandwidth to fit")
    return float(max(alpha, 0.0)), float(1.0 / beta)


# ---- collectives on K ranks, N bytes (Lab 01) -------------------------------------------
# nccl-tests' bus bandwidth factors: busbw = algbw x factor, with S the whole array.
_BUS_FACTORS = {
    "all_reduce": lambda k: 2 * (k - 1) / k,
    "reduce_scatter": lambda k: (k - 1) / k,
    "all_gather": lambda k: (k - 1) / k,
    "all_to_all": lambda k: (k - 1) / k,
    "broadcast": lambda k: 1.0,
    "reduce": lambda k: 1.0,
    "send_recv": lambda k: 1.0,
}


def bus_factor(op, nranks):
    """nccl-tests factor turning algorithm bandwidth S/t into bus bandwidth."""
    if op not in _BUS_FACTORS:
        raise ValueError(f"no bus factor for {op!r}; known: {sorted(_BUS_FACTORS)}")
    return _BUS_FACTORS[op](nranks)


def algbw(nbytes, seconds):
    return nbytes / seconds


def busbw(op, nbytes, seconds, nranks):
    return algbw(nbytes, seconds) * bus_factor(op, nranks)


def all_reduce_bytes_sent(algorithm, nbytes, k, rank):
    """Bytes ``rank`` sends in one all-reduce of ``nbytes`` on ``k`` ranks: the naive
    (reduce to rank 0, then broadcast) root sends (K-1)N and every other rank N; a ring
    rank sends 2(K-1)N/K (its reduce-scatter and all-gather each pass K-1 chunks)."""
    if k == 1:
        return 0
    if algorithm == "naive":
        return (k - 1) * nbytes if rank == 0 else nbytes
    return 2 * (k - 1) * nbytes / k


def naive_all_reduce_time(nbytes, k, alpha, bandwidth):
    """Gather to a root and send back: the root's link carries 2(K-1) full messages."""
    return 2 * (k - 1) * (alpha + nbytes / bandwidth)


def star_all_reduce_time(nbytes, k, alpha, bandwidth):
    """The naive all-reduce with each phase's K-1 messages posted at once: one latency
    per phase, but the root's link still carries K-1 whole messages each way,
    2(alpha + (K-1) N/B)."""
    return 2 * (alpha + (k - 1) * nbytes / bandwidth) if k > 1 else 0.0


def choose_all_reduce(nbytes, k, alpha, bandwidth):
    """"star" where :func:`star_all_reduce_time` beats :func:`ring_all_reduce_time`, else
    "ring" (a tie goes to the ring). The star wins below
    N* = (K-2) K alpha B / (K-1)^2 (:func:`star_ring_crossover`): never at K = 2."""
    star = star_all_reduce_time(nbytes, k, alpha, bandwidth)
    return "star" if star < ring_all_reduce_time(nbytes, k, alpha, bandwidth) else "ring"


def star_ring_crossover(k, alpha, bandwidth):
    """N* in bytes, where the star and the ring all-reduce take equal time:
    2(alpha + (K-1)N/B) = 2(K-1)(alpha + N/(KB))."""
    return (k - 2) * k * alpha * bandwidth / (k - 1) ** 2 if k > 2 else 0.0


def ring_all_reduce_time(nbytes, k, alpha, bandwidth):
    """Reduce-scatter + all-gather: 2(K-1) steps of N/K bytes."""
    return 2 * (k - 1) * (alpha + nbytes / (k * bandwidth))


def reduce_scatter_time(nbytes, k, alpha, bandwidth):
    """Ring reduce-scatter (or all-gather) of an N-byte array: K-1 steps of N/K."""
    return (k - 1) * (alpha + nbytes / (k * bandwidth))


all_gather_time = reduce_scatter_time


def ring_broadcast_time(nbytes, k, alpha, bandwidth):
    """Unsegmented chain: every hop carries the whole message, (K-1)(alpha + N/B)."""
    return (k - 1) * (alpha + nbytes / bandwidth)


def pipelined_broadcast_time(nbytes, k, segments, alpha, bandwidth):
    """Chain with S segments: (K-2+S)(alpha + N/(S B)); S = 1 gives the ring."""
    return (k - 2 + segments) * (alpha + nbytes / (segments * bandwidth))


def optimal_segments(nbytes, k, alpha, bandwidth):
    """S* = sqrt((K-2) N / (alpha B)), the minimum of (K-2+S)(alpha + N/(S B)),
    rounded to the better neighbouring integer (at least 1)."""
    if k <= 2 or alpha <= 0:
        # with two ranks there is no pipeline to fill: more segments only add latency
        return 1
    s = (max(k - 2, 0) * nbytes / (alpha * bandwidth)) ** 0.5
    candidates = {max(1, int(s)), max(1, int(s) + 1)}
    return min(candidates, key=lambda c: pipelined_broadcast_time(nbytes, k, c, alpha, bandwidth))


# ---- what a GPU node would show (projected, not measured) ------------------------------------
# One 8 x H100 SXM node: every GPU reaches the NVSwitch over 18 NVLink 4 links of 25 GB/s
# each way, 450 GB/s, and a message pays about 3 us before its first byte (the same
# figures as course_lib.tp.volume and course_lib.hybrid.costs; a test keeps them equal).
H100_NODE = {"name": "8 x H100 (NVSwitch)", "ranks": 8, "alpha": 3e-6, "bandwidth": 450e9}


def projected_busbw(sizes, k, alpha, bandwidth):
    """{"naive": [...], "ring": [...]}: the bus bandwidth (bytes/s) the alpha-beta model
    gives each all-reduce of ``sizes`` bytes on ``k`` ranks whose links each carry
    ``bandwidth``: the ring's tends to B, the naive root's to B/K (its one link
    carries 2(K-1) whole messages while busbw counts 2(K-1)/K of one)."""
    times = {"naive": naive_all_reduce_time, "ring": ring_all_reduce_time}
    return {name: [busbw("all_reduce", n, model(n, k, alpha, bandwidth), k) for n in sizes]
            for name, model in times.items()}
