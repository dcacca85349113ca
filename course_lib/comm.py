"""Counted point-to-point communication: every from-scratch algorithm sends through here.

Each call counts messages and bytes per rank and per peer, and (when the
launcher is recording) leaves a ``comm`` span on the timeline. A check reads
the counts to grade the algorithm, not just its answer::

    with comm.counting() as stats:
        ring_all_reduce(x)
    stats.sent_messages, stats.sent_bytes        # 2(n-1), ~2(n-1)/n * x.nbytes

Collectives are counted too, whichever implementation runs them, when they go
through :func:`course_lib.collectives.collective_ops` (DDP, FSDP and tensor
parallelism do): ``stats.collectives["all_reduce"]`` is the number of calls on
this rank and ``stats.collective_bytes["all_reduce"]`` their bytes (S, the whole
array, as nccl-tests count it: the output of an all-gather, the input of a
reduce-scatter).

Every call takes a process group (``group=None``: the world) and ranks *local
to that group*, as torch's ``group_dst`` / ``group_src``: on a tensor-parallel
group of global ranks {4, 5}, ``send(x, dst=1, group=tp)`` goes to global rank
5, and the counters record peer 1.

``tag`` keeps two streams between the same pair of ranks apart (a pipeline's
activations and gradients). gloo matches a receive to a send by (peer, tag),
in posting order within each tag. NCCL has no tags: it ignores them and
matches messages between two ranks purely in the order they were posted, so
code that must also run on NCCL posts its messages in the same order on both
sides and leaves the tag out (under NCCL's rules a tag is refused).

:func:`exchange` posts all sends and receives of one step together: through
``batch_isend_irecv`` on NCCL, where separate blocking send/recv pairs can
deadlock, and as plain non-blocking posts on gloo, which is as safe there (under
NCCL's rules, :mod:`course_lib.runtime.nccl_rules`, gloo takes NCCL's path).
Non-blocking calls return a :class:`~course_lib.handle.Handle`.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from course_lib import trace
from course_lib.handle import Handle
from course_lib.runtime import nccl_rules


@dataclass
class CommStats:
    """Traffic of one rank. ``sent_to[peer]`` and ``recv_from[peer]`` are bytes;
    ``collectives[name]`` calls and ``collective_bytes[name]`` their bytes."""
    sent_messages: int = 0
    sent_bytes: int = 0
    exchanges: int = 0  # calls of exchange(_async) that posted something: rounds of latency
    recv_messages: int = 0
    recv_bytes: int = 0
    sent_to: Counter = field(default_factory=Counter)
    recv_from: Counter = field(default_factory=Counter)
    collectives: Counter = field(default_factory=Counter)
    collective_bytes: Counter = field(default_factory=Counter)

    def add_send(self, nbytes, peer):
        self.sent_messages += 1
        self.sent_bytes += nbytes
        self.sent_to[peer] += nbytes

    def add_recv(self, nbytes, peer):
        self.recv_messages += 1
        self.recv_bytes += nbytes
        self.recv_from[peer] += nbytes

    def add_collective(self, name, nbytes):
        self.collectives[name] += 1
        self.collective_bytes[name] += nbytes

    def as_dict(self):
        return {"sent_messages": self.sent_messages, "sent_bytes": self.sent_bytes,
                "exchanges": self.exchanges,
                "recv_messages": self.recv_messages, "recv_bytes": self.recv_bytes,
                "sent_to": dict(self.sent_to), "recv_from": dict(self.recv_from),
                "collectives": dict(self.collectives),
                "collective_bytes": dict(self.collective_bytes)}


_active: list[CommStats] = []  # every open counting() context counts every message


@contextmanager
def counting():
    """Count this rank's point-to-point traffic inside the block (nestable)."""
    stats = CommStats()
    _active.append(stats)
    try:
        yield stats
    finally:
        # by identity: two blocks with equal counts are equal dataclasses, and
        # list.remove would take the first of them, perhaps the outer block's
        del _active[next(i for i, s in enumerate(_active) if s is stats)]


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


def _check_peer(peer, group):
    """``peer`` must be another member of ``group``, named by its group-local rank."""
    me = dist.get_rank(group)
    if me < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of this process group")
    size = dist.get_world_size(group)
    if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < size:
        raise ValueError(f"peer must be a group-local rank in [0, {size}), got {peer!r}")
    if peer == me:
        raise ValueError(f"rank {me} of the group tried to send to / receive from itself")


def _count_send(tensor, peer):
    for stats in _active:
        stats.add_send(_nbytes(tensor), peer)


def _count_recv(tensor, peer):
    for stats in _active:
        stats.add_recv(_nbytes(tensor), peer)


def count_collective(name, tensor):
    """Count one call of collective ``name`` on ``tensor`` (its whole array, S)."""
    for stats in _active:
        stats.add_collective(name, _nbytes(tensor))


def send(tensor, dst, group=None, tag=0):
    """Blocking send of ``tensor`` to group-local rank ``dst``."""
    _check_peer(dst, group)
    _count_send(tensor, dst)
    with trace.span(f"send→{dst}", "comm", bytes=_nbytes(tensor), peer=dst):
        dist.send(tensor, group=group, tag=tag, group_dst=dst)


def recv(tensor, src, group=None, tag=0):
    """Blocking receive into ``tensor`` from group-local rank ``src``; returns ``src``."""
    _check_peer(src, group)
    _count_recv(tensor, src)
    with trace.span(f"recv←{src}", "comm", bytes=_nbytes(tensor), peer=src):
        dist.recv(tensor, group=group, tag=tag, group_src=src)
    return src


def isend(tensor, dst, group=None, tag=0):
    """Non-blocking send to group-local rank ``dst``; returns a Handle. Do not
    modify ``tensor`` until the handle has completed."""
    _check_peer(dst, group)
    _count_send(tensor, dst)
    handle = Handle.from_works(dist.isend(tensor, group=group, tag=tag, group_dst=dst), p2p=True)
    return trace.async_span(f"isend→{dst}", "comm", handle, bytes=_nbytes(tensor), peer=dst)


def irecv(tensor, src, group=None, tag=0):
    """Non-blocking receive from group-local rank ``src``; returns a Handle."""
    _check_peer(src, group)
    _count_recv(tensor, src)
    handle = Handle.from_works(dist.irecv(tensor, group=group, tag=tag, group_src=src), p2p=True)
    return trace.async_span(f"irecv←{src}", "comm", handle, bytes=_nbytes(tensor), peer=src)


def exchange_async(sends=(), recvs=(), group=None, tag=0):
    """Post every ``(tensor, peer)`` send and receive of one step at once (peers
    group-local); returns one Handle for the whole step. On NCCL they go through
    ``batch_isend_irecv`` (one group call, so pairs cannot deadlock); gloo posts
    each message directly, which is just as safe there and saves a coalescing
    pass per step.

    A message may carry its own tag, ``(tensor, peer, tag)``, overriding ``tag``:
    one step can then send a pipeline's activations and receive its gradients
    on two streams and still be one group on NCCL."""
    sends = [_tagged(message, tag) for message in sends]
    recvs = [_tagged(message, tag) for message in recvs]
    for _, peer, _ in (*sends, *recvs):
        _check_peer(peer, group)
    if not sends and not recvs:
        return Handle.completed()
    for tensor, peer, _ in sends:
        _count_send(tensor, peer)
    for tensor, peer, _ in recvs:
        _count_recv(tensor, peer)
    for stats in _active:
        stats.exchanges += 1
    if dist.get_backend(group) == "gloo" and not nccl_rules.active():
        # receives first: a gloo sender pushes its bytes once the peer has posted
        works = [dist.irecv(t, group=group, tag=g, group_src=p) for t, p, g in recvs]
        works += [dist.isend(t, group=group, tag=g, group_dst=p) for t, p, g in sends]
    else:
        ops = [dist.P2POp(dist.isend, t, group=group, tag=g, group_peer=p) for t, p, g in sends]
        ops += [dist.P2POp(dist.irecv, t, group=group, tag=g, group_peer=p) for t, p, g in recvs]
        works = dist.batch_isend_irecv(ops)
    handle = Handle.from_works(works, p2p=True)
    if trace.get_tracer() is None:
        return handle
    nbytes = sum(_nbytes(t) for t, _, _ in sends)
    peers = sorted({p for _, p, _ in sends} | {p for _, p, _ in recvs})
    # One span for the whole step: it ends when the last of its messages is done.
    return trace.async_span("exchange " + ",".join(map(str, peers)), "comm", handle,
                            bytes=nbytes, peer=(sends or recvs)[0][1], args_peers=peers)


def _tagged(message, default_tag):
    """``(tensor, peer)`` or ``(tensor, peer, tag)`` as ``(tensor, peer, tag)``."""
    if len(message) == 2:
        return (*message, default_tag)
    if len(message) == 3:
        return tuple(message)
    raise ValueError(f"a message is (tensor, peer) or (tensor, peer, tag), got {len(message)} items")


def exchange(sends=(), recvs=(), group=None, tag=0):
    """Blocking :func:`exchange_async`: returns when every message has arrived."""
    exchange_async(sends, recvs, group, tag).wait()
