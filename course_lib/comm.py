"""Counted point-to-point communication: every from-scratch algorithm sends through here.

Each call counts messages and bytes per rank and per peer, and (when the
launcher is recording) leaves a ``comm`` span on the timeline. A check reads
the counts to grade the algorithm, not just its answer::

    with comm.counting() as stats:
        ring_all_reduce(x)
    stats.sent_messages, stats.sent_bytes        # 2(n-1), ~2(n-1)/n * x.nbytes

:func:`exchange` posts all sends and receives of one step together: through
``batch_isend_irecv`` on NCCL, where separate blocking send/recv pairs can
deadlock, and as plain non-blocking posts on gloo, which is as safe there.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from course_lib import trace


@dataclass
class CommStats:
    """Traffic of one rank. ``sent_to[peer]`` and ``recv_from[peer]`` are bytes."""
    sent_messages: int = 0
    sent_bytes: int = 0
    recv_messages: int = 0
    recv_bytes: int = 0
    sent_to: Counter = field(default_factory=Counter)
    recv_from: Counter = field(default_factory=Counter)

    def add_send(self, nbytes, peer):
        self.sent_messages += 1
        self.sent_bytes += nbytes
        self.sent_to[peer] += nbytes

    def add_recv(self, nbytes, peer):
        self.recv_messages += 1
        self.recv_bytes += nbytes
        self.recv_from[peer] += nbytes

    def as_dict(self):
        return {"sent_messages": self.sent_messages, "sent_bytes": self.sent_bytes,
                "recv_messages": self.recv_messages, "recv_bytes": self.recv_bytes,
                "sent_to": dict(self.sent_to), "recv_from": dict(self.recv_from)}


_active: list[CommStats] = []  # every open counting() context counts every message


@contextmanager
def counting():
    """Count this rank's point-to-point traffic inside the block (nestable)."""
    stats = CommStats()
    _active.append(stats)
    try:
        yield stats
    finally:
        _active.remove(stats)


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


def _check_peer(peer, group):
    world = dist.get_world_size(group)
    if not isinstance(peer, int) or not 0 <= peer < world:
        raise ValueError(f"peer must be a rank in [0, {world}), got {peer!r}")
    me = dist.get_rank()
    if peer == me:
        raise ValueError(f"rank {me} tried to send to / receive from itself")


def _count_send(tensor, peer):
    for stats in _active:
        stats.add_send(_nbytes(tensor), peer)


def _count_recv(tensor, peer):
    for stats in _active:
        stats.add_recv(_nbytes(tensor), peer)


def send(tensor, dst, group=None, tag=0):
    """Blocking send of ``tensor`` to rank ``dst``."""
    _check_peer(dst, group)
    _count_send(tensor, dst)
    with trace.span(f"send→{dst}", "comm", bytes=_nbytes(tensor), peer=dst):
        dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor, src, group=None, tag=0):
    """Blocking receive into ``tensor`` from rank ``src``."""
    _check_peer(src, group)
    _count_recv(tensor, src)
    with trace.span(f"recv←{src}", "comm", bytes=_nbytes(tensor), peer=src):
        dist.recv(tensor, src, group=group, tag=tag)
    return src


def isend(tensor, dst, group=None, tag=0):
    """Non-blocking send; returns a work to ``wait()`` on."""
    _check_peer(dst, group)
    _count_send(tensor, dst)
    work = dist.isend(tensor, dst, group=group, tag=tag)
    return trace.async_span(f"isend→{dst}", "comm", work, bytes=_nbytes(tensor), peer=dst)


def irecv(tensor, src, group=None, tag=0):
    """Non-blocking receive; returns a work to ``wait()`` on."""
    _check_peer(src, group)
    _count_recv(tensor, src)
    work = dist.irecv(tensor, src, group=group, tag=tag)
    return trace.async_span(f"irecv←{src}", "comm", work, bytes=_nbytes(tensor), peer=src)


def exchange_async(sends=(), recvs=(), group=None):
    """Post every ``(tensor, peer)`` send and receive of one step at once; returns
    the works (wait on all of them). On NCCL they go through ``batch_isend_irecv``
    (one group call, so pairs cannot deadlock); gloo posts each message directly,
    which is just as safe there and saves a coalescing pass per step."""
    for _, peer in (*sends, *recvs):
        _check_peer(peer, group)
    if not sends and not recvs:
        return []
    for tensor, peer in sends:
        _count_send(tensor, peer)
    for tensor, peer in recvs:
        _count_recv(tensor, peer)
    if dist.get_backend(group) == "gloo":
        # receives first: a gloo sender pushes its bytes once the peer has posted
        works = [dist.irecv(t, p, group=group) for t, p in recvs]
        works += [dist.isend(t, p, group=group) for t, p in sends]
    else:
        ops = [dist.P2POp(dist.isend, t, p, group) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, p, group) for t, p in recvs]
        works = dist.batch_isend_irecv(ops)
    if trace.get_tracer() is None:
        return works
    nbytes = sum(_nbytes(t) for t, _ in sends)
    peers = sorted({p for _, p in sends} | {p for _, p in recvs})
    # One span for the whole step: it ends when the last of its messages is done.
    return trace.async_span("exchange " + ",".join(map(str, peers)), "comm", works,
                            bytes=nbytes, peer=(sends or recvs)[0][1], args_peers=peers)


def exchange(sends=(), recvs=(), group=None):
    """Blocking :func:`exchange_async`: returns when every message has arrived."""
    for work in exchange_async(sends, recvs, group):
        work.wait()
