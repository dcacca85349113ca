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
