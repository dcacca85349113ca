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
all_reduce (ring)           2(K-1) of N/K            2(K-1)(alpha + N/(K B))
reduce_scatter (ring)       K-1 of N/K               (K-1)(alpha + N/(K B))
all_gather (ring)           K-1 of N/K               (K-1)(alpha + N/(K B))
==========================  =======================  ==========================

The ring all-reduce is a ring reduce-scatter followed by a ring all-gather
(AllReduce = ReduceScatter + AllGather). Every step is one
:func:`~course_lib.comm.exchange` (``batch_isend_irecv``), so it is safe on NCCL.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm, trace

ReduceOp = dist.ReduceOp
_OPS = {ReduceOp.SUM: "SUM", ReduceOp.AVG: "AVG", ReduceOp.MAX: "MAX", ReduceOp.MIN: "MIN",
        ReduceOp.PRODUCT: "PRODUCT"}


# ---- helpers ---------------------------------------------------------------------------
def _validate(tensor, op=None, root=None, name="tensor"):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if op is not None:
        if op not in _OPS:
            raise ValueError(f"unsupported op {op!r}; use one of {list(_OPS.values())}")
        if op == ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
            raise ValueError(f"AVG of {tensor.dtype} is not defined (as in torch): "
                             "use SUM and divide")
    if root is not None and not 0 <= root < dist.get_world_size():
        raise ValueError(f"root rank {root} is not in [0, {dist.get_world_size()})")


def combine(acc, incoming, op):
    """acc <- acc (op) incoming, in place. AVG sums here and divides at the end."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        acc.add_(incoming)
    elif op == ReduceOp.PRODUCT:
        acc.mul_(incoming)
    elif op == ReduceOp.MAX:
        torch.maximum(acc, incoming, out=acc)
    else:
        torch.minimum(acc, incoming, out=acc)


def chunk_bounds(numel, parts):
    """[(start, stop)] of ``parts`` near-equal chunks: the first numel % parts get
    one element more, so no chunk exceeds ceil(numel / parts)."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class _Flat:
    """A contiguous 1-D view of ``tensor`` (a copy if it is not contiguous), and
    the way back."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)

    def done(self):
        if self.flat.data_ptr() != self.tensor.data_ptr() or not self.tensor.is_contiguous():
            self.tensor.copy_(self.flat.view_as(self.tensor))
        return self.tensor


def _ring():
    rank, world = dist.get_rank(), dist.get_world_size()
    return rank, world, (rank + 1) % world, (rank - 1) % world


def ring_step_chunks(rank, world, step, phase):
    """(chunk sent right, chunk received from the left) by ``rank`` at ``step``.

    reduce-scatter, step s in [0, K-2]: send the partial of chunk r-s-1, receive
    that of chunk r-s-2 (and add your own); after K-1 steps rank r holds chunk r.
    all-gather, step s in [0, K-2]: forward chunk r-s, receive chunk r-s-1."""
    if phase == "reduce_scatter":
        return (rank - step - 1) % world, (rank - step - 2) % world
    if phase == "all_gather":
        return (rank - step) % world, (rank - step - 1) % world
    raise ValueError(f"unknown phase {phase!r}")


# ---- one-to-all and all-to-one ---------------------------------------------------------
def broadcast(tensor, src):
    """Flat tree: ``src`` sends the whole tensor to every other rank in turn."""
    _validate(tensor, root=src)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1 or tensor.numel() == 0:
        return tensor
    data = _Flat(tensor)
    if rank == src:
        for peer in range(world):
            if peer != src:
                comm.exchange(sends=[(data.flat, peer)])
    else:
        comm.exchange(recvs=[(data.flat, src)])
    return data.done()


def ring_broadcast(tensor, src):
    """Chain src -> src+1 -> ... -> src-1: each rank receives the whole tensor and
    forwards it, (K-1) N/B."""
    return pipelined_broadcast(tensor, src, segments=1)


def pipelined_broadcast(tensor, src, segments):
    """Chain broadcast with the tensor cut into S segments. Chain position p
    receives segment j at step j+p-1 and forwards it at step j+p, so all K ranks
    are done after K-2+S steps of N/S bytes: (K-2+S) N/(S B), about N/B for S >> K."""
    _validate(tensor, root=src)
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments must be a positive integer, got {segments!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1 or tensor.numel() == 0:
        return tensor
    data = _Flat(tensor)
    bounds = [b for b in chunk_bounds(data.flat.numel(), segments) if b[1] > b[0]]
    pos = (rank - src) % world  # position in the chain; the root is 0
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(len(bounds) + world - 2):
        send_seg, recv_seg = step - pos, step - pos + 1
        sends = ([(data.flat[slice(*bounds[send_seg])], right)]
                 if pos < world - 1 and 0 <= send_seg < len(bounds) else [])
        recvs = ([(data.flat[slice(*bounds[recv_seg])], left)]
                 if pos > 0 and 0 <= recv_seg < len(bounds) else [])
        comm.exchange(sends, recvs)
    return data.done()


def reduce(tensor, dst, op=ReduceOp.SUM):
    """Chain reduce towards ``dst``: the partial result travels dst+1 -> dst+2 ->
    ... -> dst, each rank combining its own tensor in. Only ``dst``'s tensor is
    written; (K-1)(alpha + N/B)."""
    _validate(tensor, op, root=dst)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = _Flat(tensor)
    if world > 1 and tensor.numel() > 0:
        pos = (rank - dst - 1) % world  # dst+1 starts the chain, dst ends it
        right, left = (rank + 1) % world, (rank - 1) % world
        partial = data.flat if rank == dst else data.flat.clone()
        if pos > 0:
            incoming = torch.empty_like(partial)
            comm.exchange(recvs=[(incoming, left)])
            combine(partial, incoming, op)
        if rank != dst:
            comm.exchange(sends=[(partial, right)])
    if rank == dst and op == ReduceOp.AVG:
        data.flat.div_(world)
    return data.done() if rank == dst else tensor


# ---- all-to-all patterns ---------------------------------------------------------------
def naive_all_reduce(tensor, op=ReduceOp.SUM, root=0):
    """Everyone sends the whole tensor to ``root``, which reduces and sends the
    result back to everyone: the root moves 2(K-1) N bytes, the others 2N."""
    _validate(tensor, op, root=root)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = _Flat(tensor)
    if world > 1 and tensor.numel() > 0:
        if rank == root:
            incoming = torch.empty_like(data.flat)
            for peer in range(world):
                if peer != root:
                    comm.exchange(recvs=[(incoming, peer)])
                    combine(data.flat, incoming, op)
            if op == ReduceOp.AVG:
                data.flat.div_(world)
            for peer in range(world):
                if peer != root:
                    comm.exchange(sends=[(data.flat, peer)])
        else:
            comm.exchange(sends=[(data.flat, root)])
            comm.exchange(recvs=[(data.flat, root)])
        return data.done()
    if op == ReduceOp.AVG:
        data.flat.div_(world)
    return data.done()


def _ring_reduce_scatter(flat, bounds, op, out):
    """K-1 ring steps; at step s rank r sends the partial of chunk r-s-1 and
    receives that of chunk r-s-2, adding its own. Afterwards ``out`` holds the
    full reduction of chunk r. ``flat`` is only read."""
    rank, world, right, left = _ring()
    biggest = max(stop - start for start, stop in bounds)
    buffers = [torch.empty(biggest, dtype=flat.dtype, device=flat.device) for _ in range(2)]
    sending = None  # step 0 sends this rank's own chunk straight from `flat`
    for step in range(world - 1):
        send_c, recv_c = ring_step_chunks(rank, world, step, "reduce_scatter")
        outgoing = flat[slice(*bounds[send_c])] if sending is None else sending
        size = bounds[recv_c][1] - bounds[recv_c][0]
        incoming = buffers[step % 2][:size]
        comm.exchange(sends=[(outgoing, right)] if outgoing.numel() else [],
                      recvs=[(incoming, left)] if size else [])
        with trace.span(f"reduce chunk {recv_c}", "compute"):
            combine(incoming, flat[slice(*bounds[recv_c])], op)
        sending = incoming
    out.copy_(sending if sending is not None else flat[slice(*bounds[rank])])


def _ring_all_gather(flat, bounds):
    """K-1 ring steps; at step s rank r forwards chunk r-s and receives chunk r-s-1
    straight into place."""
    rank, world, right, left = _ring()
    for step in range(world - 1):
        send_c, recv_c = ring_step_chunks(rank, world, step, "all_gather")
        outgoing, incoming = flat[slice(*bounds[send_c])], flat[slice(*bounds[recv_c])]
        comm.exchange(sends=[(outgoing, right)] if outgoing.numel() else [],
                      recvs=[(incoming, left)] if incoming.numel() else [])


def all_reduce(tensor, op=ReduceOp.SUM):
    """Bandwidth-optimal ring all-reduce, in place: reduce-scatter, then all-gather,
    over K near-equal chunks. 2(K-1) messages of at most ceil(N/K) elements per rank."""
    _validate(tensor, op)
    world = dist.get_world_size()
    data = _Flat(tensor)
    if world > 1 and tensor.numel() > 0:
        bounds = chunk_bounds(data.flat.numel(), world)
        mine = data.flat[slice(*bounds[dist.get_rank()])]
        _ring_reduce_scatter(data.flat, bounds, op, mine)
        if op == ReduceOp.AVG:
            mine.div_(world)
        _ring_all_gather(data.flat, bounds)
    elif op == ReduceOp.AVG:
        data.flat.div_(world)
    return data.done()


def _check_pair(output, input, factor, what):
    _validate(output, name="output")
    _validate(input, name="input")
    if output.dtype != input.dtype:
        raise ValueError(f"{what}: output dtype {output.dtype} differs from input dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{what}: output is on {output.device}, input on {input.device}")
    big, small = (input, output) if what == "reduce_scatter" else (output, input)
    if big.numel() != factor * small.numel():
        raise ValueError(f"{what}: with world size {factor} the "
                         f"{'input' if big is input else 'output'} must have {factor} x "
                         f"{small.numel()} = {factor * small.numel()} elements, "
                         f"it has {big.numel()}")


def reduce_scatter(output, input, op=ReduceOp.SUM):
    """Like ``dist.reduce_scatter_tensor``: ``input`` is K chunks the size of
    ``output``; rank r's ``output`` gets the reduction of everyone's chunk r.
    K-1 messages of N/K per rank (N = input size); ``input`` is not modified."""
    world = dist.get_world_size()
    _check_pair(output, input, world, "reduce_scatter")
    _validate(input, op)
    out = _Flat(output)
    flat_in = input.reshape(-1) if input.is_contiguous() else input.contiguous().view(-1)
    n = out.flat.numel()
    bounds = [(r * n, (r + 1) * n) for r in range(world)]
    if world == 1 or n == 0:
        out.flat.copy_(flat_in)
    else:
        _ring_reduce_scatter(flat_in, bounds, op, out.flat)
    if op == ReduceOp.AVG:
        out.flat.div_(world)
    return out.done()


def all_gather(output, input):
    """Like ``dist.all_gather_into_tensor``: rank r's ``input`` lands in chunk r of
    every rank's ``output``. K-1 messages of N/K per rank (N = output size)."""
    world = dist.get_world_size()
    _check_pair(output, input, world, "all_gather")
    out = _Flat(output)
    n = input.numel()
    bounds = [(r * n, (r + 1) * n) for r in range(world)]
    out.flat[slice(*bounds[dist.get_rank()])].copy_(input.reshape(-1))
    if world > 1 and n > 0:
        _ring_all_gather(out.flat, bounds)
    return out.done()
