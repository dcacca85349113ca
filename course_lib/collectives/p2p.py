"""Point-to-point patterns of Lab 00, as reference implementations.

All go through :mod:`course_lib.comm`, so their messages are counted and drawn.

- ``ping_pong``: rank 0 sends, rank 1 echoes; the round trip is 2(alpha + n/B).
- ``token_ring``: a token travels 0 -> 1 -> ... -> n-1 -> 0, each rank adding
  its rank; messages are strictly ordered, so blocking send/recv is safe.
- ``ring_shift``: every rank sends right and receives from the left *at the
  same time*; with blocking calls every rank would wait in ``send`` for a
  ``recv`` nobody has posted yet (a deadlock), so one step is one
  :func:`~course_lib.comm.exchange`. This step is the building block of every
  ring collective in Lab 01.

Each takes a process group (the world by default); ranks are local to it.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from course_lib import comm, trace
from course_lib.runtime.device import sync


def ping_pong(payload, iters, group=None):
    """Group rank 0 sends ``payload`` to group rank 1, which sends it back,
    ``iters`` times. Returns ``(last tensor received, [round-trip seconds])``;
    other ranks take no part and return ``(None, [])``.

    On a GPU a send returns once it is enqueued, so each round trip is timed
    between two :func:`~course_lib.runtime.device.sync` calls: the clock starts
    with the device idle and stops once the echo has landed in ``buf``."""
    rank = dist.get_rank(group)
    buf = torch.empty_like(payload)
    times = []
    for _ in range(iters):
        if rank == 0:
            sync()
            start = time.perf_counter()
            comm.send(payload, 1, group)
            comm.recv(buf, 1, group)
            sync()
            times.append(time.perf_counter() - start)
        elif rank == 1:
            comm.recv(buf, 0, group)
            comm.send(buf, 0, group)
    return (buf if rank in (0, 1) else None), times


def token_ring(token, group=None):
    """Pass ``token`` around the ring once, each rank r > 0 adding r. Rank r > 0
    returns the token it sent on, token + r(r+1)/2; rank 0 the token that came
    back, token + n(n-1)/2."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return token.clone()
    right, left = (rank + 1) % world, (rank - 1) % world
    if rank == 0:
        comm.send(token, right, group)
        back = torch.empty_like(token)
        comm.recv(back, left, group)
        return back
    received = torch.empty_like(token)
    comm.recv(received, left, group)
    passed_on = received + rank
    comm.send(passed_on, right, group)
    return passed_on


def ring_shift(x, group=None):
    """Return the ``x`` of rank (r - 1) mod n: one simultaneous send-right,
    receive-left step."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return x.clone()
    out = torch.empty_like(x)
    comm.exchange(sends=[(x, (rank + 1) % world)], recvs=[(out, (rank - 1) % world)], group=group)
    return out


def measure_ping_pong(ping_pong_fn, sizes_bytes, iters=20, warmup=3):
    """One-way time (half the fastest of ``iters`` round trips) per message size, on
    rank 0. The fastest, not the median: on a shared machine other processes only ever
    add time, and a burst of them can slow most of the round trips of a small message,
    which would tilt the alpha-beta fit (even make the bandwidth negative). Run it on at
    least 2 ranks; returns {bytes: seconds} on rank 0, {} elsewhere."""
    result = {}
    for nbytes in sizes_bytes:
        payload = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        ping_pong_fn(payload, warmup)
        sync()  # the warm-up's messages are off the device before the timed ones
        with trace.span(f"ping-pong {nbytes} B", "other"):
            _, times = ping_pong_fn(payload, iters)
            sync()
        if dist.get_rank() == 0:
            result[payload.numel() * 4] = min(times) / 2
    return result
