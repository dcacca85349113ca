"""Collectives from scratch, on counted point-to-point messages only.

Each function has the semantics of its torch counterpart and works on any rank
of an initialised process group, for any number of elements. With K ranks, an
N-byte tensor, latency alpha and bandwidth B:

==========================  =======================  ==========================
function                    messages per rank        time (alpha-beta model)
==========================  =======================  ==========================
broadcast (flat tree)       root: K-1                (K-1)(alpha + N/B)
ring_broadcast (chain)      1                        (K-1)(alpha + N/B)
pipelined_broadcast (S)     S                        (K-2+S)(alpha + N/(S B))
reduce (chain)              1                        (K-1)(alpha + N/B)
naive_all_reduce            root: 2(K-1)             2(K-1)(alpha + N/B)
star_all_reduce             root: 2(K-1), at once    2(alpha + (K-1)N/B)
all_reduce (ring)           2(K-1) of N/K            2(K-1)(alpha + N/(K B))
reduce_scatter (ring)       K-1 of N/K               (K-1)(alpha + N/(K B))
all_gather (ring)           K-1 of N/K               (K-1)(alpha + N/(K B))
all_to_all (even splits)    K-1 of N/K, at once      alpha + (K-1)N/(K B)
==========================  =======================  ==========================

Files: :mod:`~course_lib.collectives.p2p` (Lab 00's patterns),
:mod:`~course_lib.collectives.rooted` (broadcast, reduce, naive and star all-reduce),
:mod:`~course_lib.collectives.adaptive` (the all-reduce that picks star or ring by size),
:mod:`~course_lib.collectives.all_to_all` (all-to-all with uneven splits, and all_to_all_v),
:mod:`~course_lib.collectives.ring` (reduce-scatter, all-gather, all-reduce),
:mod:`~course_lib.collectives.reduce_ops` (ops, chunking, buffers),
:mod:`~course_lib.collectives.cost_model` and :mod:`~course_lib.collectives.ring_viz`.
"""
from course_lib.collectives.reduce_ops import ReduceOp, chunk_bounds, combine, scratch
from course_lib.collectives.select import collective_ops
from course_lib.collectives.ring import all_gather, all_reduce, reduce_scatter, ring_step_chunks
from course_lib.collectives.rooted import (broadcast, naive_all_reduce, pipelined_broadcast,
                                           reduce, ring_broadcast, star_all_reduce)
from course_lib.collectives.adaptive import adaptive_all_reduce
from course_lib.collectives.all_to_all import all_to_all, all_to_all_v

__all__ = ["broadcast", "ring_broadcast", "pipelined_broadcast", "reduce", "naive_all_reduce",
           "star_all_reduce", "adaptive_all_reduce", "all_to_all", "all_to_all_v",
           "all_reduce", "reduce_scatter", "all_gather", "ring_step_chunks", "chunk_bounds",
           "combine", "scratch", "ReduceOp", "collective_ops"]
