"""Collectives with a root, and the naive all-reduce through one: broadcast (flat
tree, chain, pipelined chain), reduce (chain), naive all-reduce (gather to the
root, send back). Every message goes through :func:`course_lib.comm.exchange`
(``batch_isend_irecv`` on NCCL), so they are safe there too."""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.collectives.reduce_ops import (Flat, ReduceOp, asynchronous, chunk_bounds, combine,
                                               validate)

__all__ = ["broadcast", "ring_broadcast", "pipelined_broadcast", "reduce", "naive_all_reduce",
           "star_all_reduce"]


# ---- one-to-all and all-to-one ---------------------------------------------------------
@asynchronous
def broadcast(tensor, src, group=None):
    """Flat tree: ``src`` (group-local) sends the whole tensor to every other rank in turn."""
    validate(tensor, root=src, group=group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1 or tensor.numel() == 0:
        return tensor
    data = Flat(tensor)
    if rank == src:
        for peer in range(world):
            if peer != src:
                comm.exchange(sends=[(data.flat, peer)], group=group)
    else:
        comm.exchange(recvs=[(data.flat, src)], group=group)
    return data.done()


@asynchronous
def ring_broadcast(tensor, src, group=None):
    """Chain src -> src+1 -> ... -> src-1: each rank receives the whole tensor and
    forwards it, (K-1) N/B."""
    return pipelined_broadcast(tensor, src, segments=1, group=group)


@asynchronous
def pipelined_broadcast(tensor, src, segments, group=None):
    """Chain broadcast with the tensor cut into S segments. Chain position p
    receives segment j at step j+p-1 and forwards it at step j+p, so all K ranks
    are done after K-2+S steps of N/S bytes: (K-2+S) N/(S B), about N/B for S >> K."""
    validate(tensor, root=src, group=group)
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments must be a positive integer, got {segments!r}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1 or tensor.numel() == 0:
        return tensor
    data = Flat(tensor)
    bounds = [b for b in chunk_bounds(data.flat.numel(), segments) if b[1] > b[0]]
    pos = (rank - src) % world  # position in the chain; the root is 0
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(len(bounds) + world - 2):
        send_seg, recv_seg = step - pos, step - pos + 1
        sends = ([(data.flat[slice(*bounds[send_seg])], right)]
                 if pos < world - 1 and 0 <= send_seg < len(bounds) else [])
        recvs = ([(data.flat[slice(*bounds[recv_seg])], left)]
                 if pos > 0 and 0 <= recv_seg < len(bounds) else [])
        comm.exchange(sends, recvs, group=group)
    return data.done()


@asynchronous
def reduce(tensor, dst, op=ReduceOp.SUM, group=None):
    """Chain reduce towards ``dst``: the partial result travels dst+1 -> dst+2 ->
    ... -> dst, each rank combining its own tensor in. Only ``dst``'s tensor is
    written; (K-1)(alpha + N/B)."""
    validate(tensor, op, root=dst, group=group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    data = Flat(tensor)
    if world > 1 and tensor.numel() > 0:
        pos = (rank - dst - 1) % world  # dst+1 starts the chain, dst ends it
        right, left = (rank + 1) % world, (rank - 1) % world
        partial = data.flat if rank == dst else data.flat.clone()
        if pos > 0:
            incoming = torch.empty_like(partial)
            comm.exchange(recvs=[(incoming, left)], group=group)
            combine(partial, incoming, op)
        if rank != dst:
            comm.exchange(sends=[(partial, right)], group=group)
    if rank == dst and op == ReduceOp.AVG:
        data.flat.div_(world)
    return data.done() if rank == dst else tensor


# ---- all-to-all patterns ---------------------------------------------------------------
def _through_root(tensor, op, root, group, at_once):
    """Everyone's tensor to ``root``, reduced there, the result back to everyone; each
    phase's K-1 messages one after the other, or all posted in one exchange."""
    validate(tensor, op, root=root, group=group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    data = Flat(tensor)
    if world > 1 and tensor.numel() > 0:
        peers = [p for p in range(world) if p != root]
        if rank != root:
            comm.exchange(sends=[(data.flat, root)], group=group)
            comm.exchange(recvs=[(data.flat, root)], group=group)
            return data.done()
        if at_once:
            incoming = [torch.empty_like(data.flat) for _ in peers]
            comm.exchange(recvs=list(zip(incoming, peers)), group=group)
            for other in incoming:
                combine(data.flat, other, op)
        else:
            incoming = torch.empty_like(data.flat)
            for peer in peers:
                comm.exchange(recvs=[(incoming, peer)], group=group)
                combine(data.flat, incoming, op)
        if op == ReduceOp.AVG:
            data.flat.div_(world)
        if at_once:
            comm.exchange(sends=[(data.flat, p) for p in peers], group=group)
        else:
            for peer in peers:
                comm.exchange(sends=[(data.flat, peer)], group=group)
        return data.done()
    if op == ReduceOp.AVG:
        data.flat.div_(world)
    return data.done()


@asynchronous
def naive_all_reduce(tensor, op=ReduceOp.SUM, root=0, group=None):
    """Everyone sends the whole tensor to ``root``, which reduces and sends the
    result back to everyone: the root moves 2(K-1) N bytes, the others 2N, one
    message after another, 2(K-1)(alpha + N/B)."""
    return _through_root(tensor, op, root, group, at_once=False)


@asynchronous
def star_all_reduce(tensor, op=ReduceOp.SUM, root=0, group=None):
    """The naive all-reduce with every message of a phase posted at once: ``root``
    receives all K-1 tensors in one exchange, reduces, and sends the result to all
    in one more. The same bytes as :func:`naive_all_reduce`, but two rounds of
    latency instead of 2(K-1): 2(alpha + (K-1)N/B), faster than the ring below
    ``cost_model.star_ring_crossover``."""
    return _through_root(tensor, op, root, group, at_once=True)
