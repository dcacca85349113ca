"""Ring collectives: reduce-scatter, all-gather, and all-reduce as the two in a row.

With K ranks and an N-element array cut into K chunks, at every step each rank
sends one chunk to its right neighbour and receives one from its left:

- reduce-scatter, K-1 steps: partial sums travel around the ring, each rank
  adding its own contribution; afterwards rank r holds the full sum of chunk r.
- all-gather, K-1 steps: the finished chunks travel around until every rank
  has all of them.
- all-reduce = reduce-scatter + all-gather: 2(K-1) steps of ceil(N/K) per
  rank, 2(K-1)/K of the array, whatever K is: the bandwidth-optimal schedule.

Pipelined segments. NCCL slices each chunk into pieces so that a piece can be
reduced and forwarded while the next one is still arriving. :func:`all_reduce`
does the same when given ``segment_bytes``: each step's chunk travels as S
segments (S from :func:`ring_segments`), segment j of step s+1 leaves as soon
as segment j of step s has arrived and been reduced, and the all-gather's
first segments leave while the reduce-scatter's last ones are still arriving.
The ring still takes 2(K-1) steps and each rank still sends exactly 2(K-1)/K
of the array; only the message count becomes 2(K-1) x S. In alpha-beta terms
each segment pays alpha again: pipelining wins only where alpha is small
against the time a segment spends on the wire and in the reduction. Measured
with gloo on a 2-core machine it never won (a message costs hundreds of
microseconds there once the cores are shared), so the default is one segment
per chunk (``SEGMENT_BYTES = None``). Lab 01's exercises keep one message per step.

On gloo every receive is posted before the first send: a gloo sender pushes
its bytes as soon as the receiver has posted, so no rank waits for its
neighbour to come round to posting. On NCCL each step is one
``batch_isend_irecv`` exchange (NCCL pipelines inside its own kernels).

All functions take a process group; ranks, chunks and neighbours are local to
it, so the same code runs on a tensor-parallel or data-parallel sub-group.
"""
from __future__ import annotations

import math
from collections import deque

import torch.distributed as dist

from course_lib import comm, trace
from course_lib.collectives.reduce_ops import (Flat, ReduceOp, chunk_bounds, combine, group_key,
                                               ring_neighbours, scratch, validate)
from course_lib.handle import Handle, run_in_order

SEGMENT_BYTES = None  # bytes per segment when the caller gives none; None: whole chunks
MAX_SEGMENTS = 16


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


def ring_segments(numel, world, element_size, backend="gloo", segment_bytes=None):
    """S, the number of segments each ring step's chunk travels in: about
    ``segment_bytes`` (default SEGMENT_BYTES; None means whole chunks) each, at
    most MAX_SEGMENTS, never more than the smallest chunk has elements; 1 on
    NCCL, which slices chunks itself."""
    segment_bytes = segment_bytes or SEGMENT_BYTES
    smallest_chunk = numel // world
    if backend != "gloo" or smallest_chunk < 2 or not segment_bytes:
        return 1
    wanted = math.ceil(smallest_chunk * element_size / segment_bytes)
    return max(1, min(wanted, MAX_SEGMENTS, smallest_chunk))


class _Ring:
    """The messages of one ring operation on ``flat`` cut at ``bounds``."""

    def __init__(self, flat, bounds, group, segments):
        self.flat, self.bounds, self.group, self.segments = flat, bounds, group, segments
        self.rank, self.world, self.right, self.left = ring_neighbours(group)
        gloo = dist.get_backend(group) == "gloo"
        # With two ranks and one segment a phase is a single exchange: nothing to
        # post ahead, and measured on gloo the plain exchange is the faster.
        self.early = gloo and (self.world > 2 or segments > 1)
        self.posted, self.sends = deque(), []

    def pieces(self, chunk):
        """The non-empty segments (start, stop) of ``chunk``, in order."""
        lo, hi = self.bounds[chunk]
        return [(lo + a, lo + b) for a, b in chunk_bounds(hi - lo, self.segments) if b > a]

    def post(self, views):
        """Post receives for ``views``, in the order the left neighbour sends them."""
        self.posted.extend(comm.irecv(v, self.left, self.group) for v in views)

    def arrived(self):
        self.posted.popleft().wait()

    def send(self, view):
        self.sends.append(comm.isend(view, self.right, self.group))

    def finish(self):
        for handle in self.sends:
            handle.wait()


def _ring_collective(flat, bounds, op, group, out, reduce_scatter, all_gather, segments):
    """Reduce-scatter into ``out`` (chunk r of ``flat`` for an all-reduce) and/or
    all-gather ``flat`` in place, as one ring. ``flat`` is only read by the
    reduce-scatter (``out`` may alias chunk r)."""
    ring = _Ring(flat, bounds, group, segments)
    rank, world = ring.rank, ring.world
    rs_plan = [ring_step_chunks(rank, world, s, "reduce_scatter") for s in range(world - 1)]
    ag_plan = [ring_step_chunks(rank, world, s, "all_gather") for s in range(world - 1)]
    # Incoming partials must not be overwritten while they are still being
    # forwarded: one buffer per step when everything is posted up front.
    incoming = []
    for s, (_, c) in enumerate(rs_plan if reduce_scatter else []):
        lo, hi = bounds[c]
        buf = scratch(hi - lo, flat, slot=s if ring.early else s % 2, group=group)
        incoming.append([(buf[a - lo:b - lo], (a, b)) for a, b in ring.pieces(c)])
    if not ring.early:
        return _stepwise(ring, rs_plan, ag_plan, incoming, op, out, reduce_scatter, all_gather)

    ring.post([view for step in incoming for view, _ in step]
              + [flat[a:b] for _, c in (ag_plan if all_gather else []) for a, b in ring.pieces(c)])
    out_lo = bounds[rank][0]
    if reduce_scatter:
        for a, b in ring.pieces(rs_plan[0][0]):  # step 0: this rank's own contribution
            ring.send(flat[a:b])
        for s, (c, _) in enumerate(rs_plan):
            last = s == world - 2
            for view, (a, b) in incoming[s]:
                ring.arrived()
                target = out[a - out_lo:b - out_lo] if last else view
                with trace.span(f"reduce chunk {c}", "compute"):
                    combine(view, flat[a:b], op, out=target)
                    if last and op == ReduceOp.AVG and all_gather:
                        target.div_(world)
                if not last or all_gather:  # the last reduced piece opens the all-gather
                    ring.send(target)
    elif all_gather:
        for a, b in ring.pieces(rank):
            ring.send(flat[a:b])
    if all_gather:
        for s, (_, c) in enumerate(ag_plan):
            for a, b in ring.pieces(c):
                ring.arrived()
                if s < world - 2:
                    ring.send(flat[a:b])
    ring.finish()


def _stepwise(ring, rs_plan, ag_plan, incoming, op, out, reduce_scatter, all_gather):
    """One ``batch_isend_irecv`` exchange per step (NCCL; gloo with two ranks)."""
    flat, world = ring.flat, ring.world
    out_lo = ring.bounds[ring.rank][0]
    if reduce_scatter:
        sending = [flat[a:b] for a, b in ring.pieces(rs_plan[0][0])]
        for s, (c, _) in enumerate(rs_plan):
            comm.exchange(sends=[(v, ring.right) for v in sending],
                          recvs=[(v, ring.left) for v, _ in incoming[s]], group=ring.group)
            last = s == world - 2
            with trace.span(f"reduce chunk {c}", "compute"):
                sending = [combine(v, flat[a:b], op,
                                   out=out[a - out_lo:b - out_lo] if last else None)
                           for v, (a, b) in incoming[s]]
        if op == ReduceOp.AVG and all_gather:
            out.div_(world)
    if all_gather:
        for send_c, recv_c in ag_plan:
            comm.exchange(sends=[(flat[a:b], ring.right) for a, b in ring.pieces(send_c)],
                          recvs=[(flat[a:b], ring.left) for a, b in ring.pieces(recv_c)],
                          group=ring.group)


def _maybe_async(async_op, group, fn, *args):
    """Run now (in this rank's issue order: behind what runs asynchronously), or on
    the rank's helper thread with a Handle to wait on (checks of the arguments have
    already run here, so errors are raised at the call)."""
    if async_op:
        return Handle.on_thread(group_key(group), fn, *args)
    return run_in_order(fn, *args)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, segment_bytes=None):
    """Bandwidth-optimal ring all-reduce, in place: reduce-scatter, then all-gather,
    over K near-equal chunks, pipelined in segments of about ``segment_bytes``
    if given (see the module's docstring). 2(K-1) steps of at most ceil(N/K)
    elements per rank; returns the tensor, or a Handle with ``async_op=True``."""
    validate(tensor, op, group=group)
    return _maybe_async(async_op, group, _all_reduce, tensor, op, group, segment_bytes)


def _all_reduce(tensor, op, group, segment_bytes):
    world = dist.get_world_size(group)
    data = Flat(tensor)
    if world > 1 and tensor.numel() > 0:
        bounds = chunk_bounds(data.flat.numel(), world)
        mine = data.flat[slice(*bounds[dist.get_rank(group)])]
        segments = ring_segments(data.flat.numel(), world, data.flat.element_size(),
                                 dist.get_backend(group), segment_bytes)
        _ring_collective(data.flat, bounds, op, group, mine, True, True, segments)
    elif op == ReduceOp.AVG:
        data.flat.div_(world)
    return data.done()


def _check_pair(output, input, factor, what):
    validate(output, name="output")
    validate(input, name="input")
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


def reduce_scatter(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """Like ``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` before 2.13):
    ``input`` is K chunks the size of ``output``; group rank r's ``output`` gets
    the reduction of everyone's chunk r. K-1 messages of N/K per rank (N = input
    size); ``input`` is not modified."""
    world = dist.get_world_size(group)
    _check_pair(output, input, world, "reduce_scatter")
    validate(input, op, group=group)
    return _maybe_async(async_op, group, _reduce_scatter, output, input, op, group)


def _reduce_scatter(output, input, op, group):
    world = dist.get_world_size(group)
    out = Flat(output)
    flat_in = input.reshape(-1) if input.is_contiguous() else input.contiguous().view(-1)
    n = out.flat.numel()
    bounds = [(r * n, (r + 1) * n) for r in range(world)]
    if world == 1 or n == 0:
        out.flat.copy_(flat_in)
    else:
        _ring_collective(flat_in, bounds, op, group, out.flat, True, False, segments=1)
    if op == ReduceOp.AVG:
        out.flat.div_(world)
    return out.done()


def all_gather(output, input, group=None, async_op=False):
    """Like ``dist.all_gather_single`` (``all_gather_into_tensor`` before 2.13): group
    rank r's ``input`` lands in chunk r of every rank's ``output``. K-1 messages
    of N/K per rank (N = output size)."""
    world = dist.get_world_size(group)
    _check_pair(output, input, world, "all_gather")
    return _maybe_async(async_op, group, _all_gather, output, input, group)


def _all_gather(output, input, group):
    world = dist.get_world_size(group)
    out = Flat(output)
    n = input.numel()
    bounds = [(r * n, (r + 1) * n) for r in range(world)]
    out.flat[slice(*bounds[dist.get_rank(group)])].copy_(input.reshape(-1))
    if world > 1 and n > 0:
        _ring_collective(out.flat, bounds, None, group, None, False, True, segments=1)
    return out.done()
