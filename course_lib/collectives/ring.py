"""Ring collectives: reduce-scatter, all-gather, and all-reduce as the two in a row.

With K ranks and an N-element array cut into K chunks, at every step each rank
sends one chunk to its right neighbour and receives one from its left:

- reduce-scatter, K-1 steps: partial sums travel around the ring, each rank
  adding its own contribution; afterwards rank r holds the full sum of chunk r.
- all-gather, K-1 steps: the finished chunks travel around until every rank
  has all of them.
- all-reduce = reduce-scatter + all-gather: 2(K-1) messages of ceil(N/K) per
  rank, 2(K-1)/K of the array, whatever K is: the bandwidth-optimal schedule.

On NCCL each step is one ``batch_isend_irecv`` exchange. On gloo with more than
two ranks every receive of a phase is posted before the first send: a gloo sender pushes its bytes as
soon as the receiver has posted, so no rank waits for its neighbour to come
round to posting (the same messages, a shorter critical path).
"""
from __future__ import annotations

import torch.distributed as dist

from course_lib import comm, trace
from course_lib.collectives.reduce_ops import (Flat, ReduceOp, chunk_bounds, combine, ring_neighbours, scratch,
                         validate)


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


class _RingPhase:
    """The messages of one phase: a send to the right and a receive from the left
    per step. ``early`` (gloo) posts every receive up front and lets sends run
    ahead, waiting only for the data the next step needs; otherwise (NCCL) each
    step is one ``batch_isend_irecv`` exchange."""

    def __init__(self, incoming, early):
        _, _, self.right, self.left = ring_neighbours()
        self.incoming, self.early, self.sends = incoming, early, []
        self.recvs = [comm.irecv(buf, self.left) if buf.numel() else None
                      for buf in incoming] if early else None

    def step(self, s, outgoing):
        """Send ``outgoing``; return once step ``s``'s incoming chunk has arrived."""
        if not self.early:
            comm.exchange(sends=[(outgoing, self.right)] if outgoing.numel() else [],
                          recvs=[(self.incoming[s], self.left)] if self.incoming[s].numel() else [])
            return
        if outgoing.numel():
            self.sends.append(comm.isend(outgoing, self.right))
        if self.recvs[s] is not None:
            self.recvs[s].wait()

    def finish(self):
        for work in self.sends:
            work.wait()


def _post_early():
    # With two ranks a phase is a single step, so there is nothing to post ahead;
    # measured on gloo, the plain exchange is then the faster of the two.
    return dist.get_backend() == "gloo" and dist.get_world_size() > 2


def _ring_reduce_scatter(flat, bounds, op, out):
    """K-1 ring steps; at step s rank r sends the partial of chunk r-s-1 and
    receives that of chunk r-s-2, adding its own. Afterwards ``out`` holds the
    full reduction of chunk r. ``flat`` is only read (``out`` may alias chunk r)."""
    rank, world, _, _ = ring_neighbours()
    early = _post_early()
    recv_chunks = [ring_step_chunks(rank, world, s, "reduce_scatter")[1] for s in range(world - 1)]
    # partials in flight must not be overwritten: one buffer per step when sends run ahead
    incoming = [scratch(bounds[c][1] - bounds[c][0], flat, slot=s if early else s % 2)
                for s, c in enumerate(recv_chunks)]
    phase = _RingPhase(incoming, early)
    sending = flat[slice(*bounds[(rank - 1) % world])]  # step 0: this rank's own chunk
    for s, c in enumerate(recv_chunks):
        phase.step(s, sending)
        last = s == world - 2  # the last partial is reduced straight into `out`
        with trace.span(f"reduce chunk {c}", "compute"):
            sending = combine(incoming[s], flat[slice(*bounds[c])], op, out=out if last else None)
    phase.finish()


def _ring_all_gather(flat, bounds):
    """K-1 ring steps; at step s rank r forwards chunk r-s and receives chunk r-s-1
    straight into place."""
    rank, world, _, _ = ring_neighbours()
    plan = [ring_step_chunks(rank, world, s, "all_gather") for s in range(world - 1)]
    phase = _RingPhase([flat[slice(*bounds[recv_c])] for _, recv_c in plan], _post_early())
    for s, (send_c, _) in enumerate(plan):
        phase.step(s, flat[slice(*bounds[send_c])])
    phase.finish()


def all_reduce(tensor, op=ReduceOp.SUM):
    """Bandwidth-optimal ring all-reduce, in place: reduce-scatter, then all-gather,
    over K near-equal chunks. 2(K-1) messages of at most ceil(N/K) elements per rank."""
    validate(tensor, op)
    world = dist.get_world_size()
    data = Flat(tensor)
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


def reduce_scatter(output, input, op=ReduceOp.SUM):
    """Like ``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` before 2.13): ``input`` is K chunks the size of
    ``output``; rank r's ``output`` gets the reduction of everyone's chunk r.
    K-1 messages of N/K per rank (N = input size); ``input`` is not modified."""
    world = dist.get_world_size()
    _check_pair(output, input, world, "reduce_scatter")
    validate(input, op)
    out = Flat(output)
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
    """Like ``dist.all_gather_single`` (``all_gather_into_tensor`` before 2.13): rank r's ``input`` lands in chunk r of
    every rank's ``output``. K-1 messages of N/K per rank (N = output size)."""
    world = dist.get_world_size()
    _check_pair(output, input, world, "all_gather")
    out = Flat(output)
    n = input.numel()
    bounds = [(r * n, (r + 1) * n) for r in range(world)]
    out.flat[slice(*bounds[dist.get_rank()])].copy_(input.reshape(-1))
    if world > 1 and n > 0:
        _ring_all_gather(out.flat, bounds)
    return out.done()
