"""An all-reduce that picks its algorithm by size, from an alpha-beta fit (Lab 01,
Exercise 1.6), as NCCL's tuner picks between its algorithms and protocols.

Two candidates, K ranks, N bytes, latency alpha and bandwidth B per link:

- the star (:func:`~course_lib.collectives.rooted.star_all_reduce`): 2(alpha + (K-1)N/B),
  two rounds of latency, but the root's link carries every message;
- the ring (:func:`~course_lib.collectives.ring.all_reduce`): 2(K-1)(alpha + N/(KB)),
  2(K-1) rounds of latency, every link carries 2(K-1)/K of N.

The star wins below N* = (K-2) K alpha B / (K-1)^2 and never at K = 2::

    alpha, bandwidth = cost_model.fit_alpha_beta(sizes, seconds)   # from a ping-pong
    adaptive_all_reduce(grad, alpha=alpha, bandwidth=bandwidth)  # star for small grads
"""
from __future__ import annotations

import torch.distributed as dist

from course_lib.collectives import ring
from course_lib.collectives.cost_model import choose_all_reduce
from course_lib.collectives.reduce_ops import ReduceOp
from course_lib.collectives.rooted import star_all_reduce

ALGORITHMS = {"star": star_all_reduce, "ring": ring.all_reduce}


def adaptive_all_reduce(tensor, op=ReduceOp.SUM, alpha=1e-5, bandwidth=1e9, group=None):
    """All-reduce ``tensor`` in place with the algorithm the alpha-beta model says is
    faster for its size on ``group`` (:func:`~course_lib.collectives.cost_model.choose_all_reduce`);
    returns the name chosen. Every rank sees the same size and K, so all choose alike."""
    choice = choose_all_reduce(tensor.numel() * tensor.element_size(),
                               dist.get_world_size(group), alpha, bandwidth)
    ALGORITHMS[choice](tensor, op, group=group)
    return choice
