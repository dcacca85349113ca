"""When does ring attention's communication hide under its compute? Projected to H100
GPUs with the course's cost model (Lab 07; a 2-core CPU cannot show it).

One ring step of causal attention on a rank holding s_l = s/n tokens of b sequences of
width h: the rank multiplies its queries with the part of one k/v block it may see
(q k^T and p v, forward), while it sends that block on (k and v, 2 b s_l h elements of e
bytes). Under the zigzag layout the lab recommends, every off-diagonal block is half
seen (:func:`block_share`, counted from the ring's own plan of pieces); under the
contiguous layout the slowest rank sees every block whole:

    compute(s_l) = 4 f b s_l^2 h / (peak x MFU)  grows as s_l^2  (f = 1/2 zigzag, 1 contiguous)
    send(s_l)    = alpha + 2 b s_l h e / B       grows as s_l

The send hides once compute >= send, at about s_l* = e (peak x MFU) / (2 f B) tokens per
rank (alpha aside): the longer each rank's chunk, the freer the ring. With a bf16 block,
an H100 at 50% of its dense peak and an NVSwitch node's 450 GB/s (a ring rank sends to
one peer, which can take all 18 of the GPU's links; the 4-GPU boards of Labs 05-06 give
a pair 150 GB/s, three times the tokens), s_l* is about 2,200 tokens under zigzag (1,100
for the contiguous layout's slowest rank); over InfiniBand (50 GB/s per GPU) about
20,000. That is why CP can span nodes for long contexts while TP, whose collectives wait
for nobody's compute, stays inside one.
"""
from __future__ import annotations

import numpy as np

from course_lib.hybrid.costs import H100_80GB, IB_ALPHA_S, NVLINK_ALPHA_S
from course_lib.tp.volume import INFINIBAND_GBPS, NVLINK_GPU_GBPS

LINKS = {"NVLink (in a node)": (NVLINK_ALPHA_S, NVLINK_GPU_GBPS * 1e9),
         "InfiniBand (across nodes)": (IB_ALPHA_S, INFINIBAND_GBPS * 1e9)}


def block_share(layout, n=8, s_local=64):
    """f: the largest share of a block that a rank computes on an off-diagonal ring step,
    the slowest rank setting the step's time, counted from the pieces the ring computes
    (:func:`~course_lib.cp.ring_attention.pieces_seen`): 1/2 under zigzag, 1 for the
    contiguous layout's last rank."""
    from course_lib.cp.ring_attention import pieces_seen, piece_scores

    return max(piece_scores(pieces_seen(n, r, (r - t) % n, True, layout, s_local))
               for r in range(n) for t in range(1, n)) / s_local ** 2


def ring_step_times(tokens_per_rank, batch, dim, link, mfu=0.5, element_size=2,
                    tflops=H100_80GB.tflops, layout="zigzag"):
    """(compute seconds, send seconds) of one off-diagonal ring step (see the module) for
    each of ``tokens_per_rank``; ``link`` a key of :data:`LINKS`."""
    alpha, bandwidth = LINKS[link]
    s = np.asarray(tokens_per_rank, dtype=float)
    compute = 4 * block_share(layout) * batch * s ** 2 * dim / (tflops * 1e12 * mfu)
    send = alpha + 2 * batch * s * dim * element_size / bandwidth
    return compute, send


def hiding_point(link, mfu=0.5, element_size=2, tflops=H100_80GB.tflops, layout="zigzag"):
    """s_l* = e (peak x MFU) / (2 f B): tokens per rank above which the send hides (alpha
    aside)."""
    _, bandwidth = LINKS[link]
    return element_size * tflops * 1e12 * mfu / (2 * block_share(layout) * bandwidth)
