"""Checks of Lab 00's exercises (ping-pong, token ring, ring shift).

Each runs the student's function under torchrun at world sizes 2 and 3 inside
``comm.counting()``, and grades both the values and the messages: how many,
how large, to whom.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.grading import checks


def _counted(fn, *args):
    with comm.counting() as stats:
        out = fn(*args)
    return out, stats.as_dict()


def _payload(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def check_ping_pong(ping_pong, world_sizes=(2, 3), iters=3, numel=1001):
    ex = "Exercise 0.1"
    payload = _payload(numel)
    nbytes = payload.numel() * payload.element_size()
    for n in world_sizes:
        outs = checks.launch(ex, _counted, ping_pong, payload, iters, nproc=n)
        for rank, ((echo, times), stats) in enumerate(outs):
            peer = {0: 1, 1: 0}.get(rank)
            want = {peer: iters * nbytes} if peer is not None else {}
            checks.expect_equal(ex, stats["sent_to"], want, rank=rank, world_size=n,
                                what="bytes sent per peer ({peer: bytes})",
                                hint="rank 0 sends to 1 and 1 echoes to 0, once per "
                                     "iteration; other ranks stay silent. Use comm.send/recv.")
            if rank == 0:
                checks.expect_close(ex, echo, payload, rank=0, world_size=n,
                                    what="the echoed payload",
                                    hint="rank 1 must send back exactly what it received")
                checks.expect_equal(ex, len(times), iters, rank=0, world_size=n,
                                    what="number of round-trip times")
                if not all(t > 0 for t in times):
                    raise checks.CheckFailed(f"{ex}: round-trip times must be positive "
                                             f"seconds, got {times}")
    checks.passed(ex, f"world sizes {list(world_sizes)}, {iters} round trips of {nbytes} B")


def check_token_ring(token_ring, world_sizes=(2, 3), numel=7):
    ex = "Exercise 0.2"
    token = torch.arange(numel, dtype=torch.float64)
    nbytes = token.numel() * token.element_size()
    for n in world_sizes:
        outs = checks.launch(ex, _counted, token_ring, token, nproc=n)
        for rank, (got, stats) in enumerate(outs):
            added = n * (n - 1) // 2 if rank == 0 else rank * (rank + 1) // 2
            checks.expect_close(ex, got, token + added, rank=rank, world_size=n,
                                what="the token" + (" that came back" if rank == 0 else
                                                    " this rank sent on"),
                                hint="rank r > 0 adds r to the token it received; rank 0 "
                                     "returns the token that arrives from rank n-1")
            checks.expect_equal(ex, stats["sent_to"], {(rank + 1) % n: nbytes}, rank=rank,
                                world_size=n, what="bytes sent per peer ({peer: bytes})",
                                hint="each rank sends the token once, to its right neighbour")
    checks.passed(ex, f"world sizes {list(world_sizes)}, a {numel}-element float64 token")


def check_ring_shift(ring_shift, world_sizes=(2, 3), numel=100_003, timeout=30.0):
    ex = "Exercise 0.3"

    def job():
        x = torch.full((numel,), float(dist.get_rank())) + torch.arange(numel) * 1e-3
        return _counted(ring_shift, x)

    for n in world_sizes:
        outs = checks.launch(ex, job, nproc=n, timeout=timeout)
        for rank, (got, stats) in enumerate(outs):
            left = (rank - 1) % n
            want = torch.full((numel,), float(left)) + torch.arange(numel) * 1e-3
            checks.expect_close(ex, got, want, rank=rank, world_size=n,
                                what=f"the tensor received (should be rank {left}'s)",
                                hint="send to (rank + 1) % n, receive from (rank - 1) % n")
            checks.expect_equal(ex, (stats["sent_messages"], stats["recv_messages"]), (1, 1),
                                rank=rank, world_size=n, what="(messages sent, received)",
                                hint="one step is one send and one receive per rank")
    checks.passed(ex, f"world sizes {list(world_sizes)}, {numel} elements")
