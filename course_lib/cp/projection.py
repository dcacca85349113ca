"""When does ring attention's communication hide under its compute? Projected to H100
GPUs with the course's cost model (Lab 07; a 2-core CPU cannot show it).

One ring step of causal attention on a rank holding s_l = s/n tokens of b sequences of
width h: the rank multiplies its queries with one k/v block (q k^T and p v, forward),
while it sends that block on (k and v, 2 b s_l h elements of e bytes):

    compute(s_l) = 4 b s_l^2 h / (peak x MFU)        grows as s_l^2
    send(s_l)    = alpha + 2 b s_l h e / B           grows as s_l

The send hides once compute >= send, at about s_l* = e (peak x MFU) / (2 B) tokens per
rank (alpha aside): the longer each rank's chunk, the freer the ring. With a bf16 block,
an H100 at 50% of its dense peak and NVLink's 450 GB/s (an NVSwitch node: a ring rank
sends to one peer, which can take all 18 of its links; a 4-GPU board's 150 GB/s per pair
gives three times more), s_l* is about a thousand tokens;
over InfiniBand (50 GB/s per GPU) about ten thousand, which is why CP can span nodes for
long contexts while TP, whose collectives wait for nobody's compute, stays inside one.
"""
from __future__ import annotations

import numpy as np

from course_lib.hybrid.costs import H100_80GB, IB_ALPHA_S, NVLINK_ALPHA_S
from course_lib.tp.volume import INFINIBAND_GBPS, NVLINK_GPU_GBPS

LINKS = {"NVLink (in a node)": (NVLINK_ALPHA_S, NVLINK_GPU_GBPS * 1e9),
         "InfiniBand (across nodes)": (IB_ALPHA_S, INFINIBAND_GBPS * 1e9)}


def ring_step_times(tokens_per_rank, batch, dim, link, mfu=0.5, element_size=2,
                    tflops=H100_80GB.tflops):
    """(compute seconds, send seconds) of one ring step (see the module) for each of
    ``tokens_per_rank``; ``link`` a key of :data:`LINKS`."""
    alpha, bandwidth = LINKS[link]
    s = np.asarray(tokens_per_rank, dtype=float)
    compute = 4 * batch * s ** 2 * dim / (tflops * 1e12 * mfu)
    send = alpha + 2 * batch * s * dim * element_size / bandwidth
    return compute, send


def hiding_point(link, mfu=0.5, element_size=2, tflops=H100_80GB.tflops):
    """s_l* = e (peak x MFU) / (2 B): tokens per rank above which the send hides (alpha
    aside)."""
    _, bandwidth = LINKS[link]
    return element_size * tflops * 1e12 * mfu / (2 * bandwidth)
