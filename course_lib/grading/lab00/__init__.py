"""Checks of Lab 00's exercises (ping-pong, token ring, ring shift).

Each runs the student's function under torchrun at world sizes 2 and 3 inside
``wire.counting()`` (the traffic as the process group saw it; no collective may be
called), and grades both the values and the messages: how many, how large, to whom.
The jobs below run on the student's ranks and only report; the checks compare, with
references of their own. Predictions 0.1 and 0.2:
:mod:`.predictions`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.grading import checks, wire
from course_lib.grading.lab00.predictions import (check_compute_share_prediction,  # noqa: F401
                                                  check_half_size_prediction)
from course_lib.grading.requests import on_ranks


# ---- on the student's ranks ------------------------------------------------------------------
def counted(fn, *args):
    """``fn(*args)`` and this rank's traffic while it ran."""
    with wire.counting(p2p_only=True) as stats:
        out = fn(*args)
    return out, stats.as_dict()


def shift_job(ring_shift, numel, seed=None):
    return counted(ring_shift, _shift_input(dist.get_rank(), numel, seed))


def token_job(token_ring, tokens):
    """Rank r gets ``tokens[r]``: in a ring only rank 0's token matters, the others'
    differ so that a token made up from a rank's own input cannot pass."""
    return counted(token_ring, tokens[dist.get_rank()])


def _shift_input(rank, numel, seed=None):
    """Rank r's tensor: a pattern that shows whose it is (r + j/1000), or, with ``seed``
    (the gradebook's hidden settings), random values."""
    if seed is not None:
        return _payload(numel, seed + rank)
    return torch.full((numel,), float(rank)) + torch.arange(numel) * 1e-3


def _hidden_world(rng, **drawn):
    """Hidden settings of a Lab 00 check: one world size of 2-4, an input seed, ``drawn``."""
    return {"world_sizes": (rng.randint(2, 4),), "seed": rng.randrange(2**31), **drawn}


# ---- the checks ------------------------------------------------------------------------------
def _payload(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), device="cpu")


@checks.check("Exercise 0.1", hidden=lambda rng: _hidden_world(
    rng, iters=rng.randint(2, 5), numel=rng.randint(2, 5000)))
def check_ping_pong(ping_pong, world_sizes=(2, 3), iters=3, numel=1001, seed=0):
    ex = "Exercise 0.1"
    payload = _payload(numel, seed)
    nbytes = payload.numel() * payload.element_size()
    for n in world_sizes:
        outs = yield on_ranks(counted, ping_pong, payload, iters, nproc=n)
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
                # what arrived, as the process group saw it: the echo is rank 1's message
                checks.expect_close(ex, stats["last_received"], payload, rank=0, world_size=n,
                                    what="the last message rank 0 received (from rank 1)",
                                    hint="rank 1 must send back exactly what it received")
                _check_round_trip_times(ex, times, iters, n)
    return f"world sizes {list(world_sizes)}, {iters} round trips of {nbytes} B"


def _check_round_trip_times(ex, times, iters, n):
    """Rank 0's ``times``: one positive duration in seconds per iteration."""
    where = f"{ex}: rank 0 of world size {n}, the round-trip times"
    if not isinstance(times, (list, tuple)):
        raise checks.CheckFailed(
            f"{where}: expected a list of {iters} floats, got {type(times).__name__}.\nHint: "
            f"return (buf, times) with times a list holding one duration per iteration.",
            exercise=ex)
    if len(times) != iters:
        if len(times) == 1 and iters > 1:
            why = ("one time for all iterations: is the clock read around the whole loop "
                   "instead of inside it?")
        elif len(times) == 0:
            why = "no time at all: does rank 0 append to `times`?"
        elif len(times) == 2 * iters:
            why = "two per iteration: append once, after the echo has come back"
        else:
            why = "append exactly one duration per iteration, on rank 0"
        raise checks.CheckFailed(f"{where}: expected {iters} of them, got {len(times)}."
                                 f"\nHint: {why}", exercise=ex)
    if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in times):
        kinds = sorted({type(t).__name__ for t in times})
        raise checks.CheckFailed(
            f"{where}: expected floats (seconds), got {', '.join(kinds)}.\nHint: store "
            f"time.perf_counter() - start, a float, not a tensor or the raw clock reading.",
            exercise=ex)
    if all(t < 0 for t in times):
        hint = ("every time is negative: subtract the start from the end, "
                "time.perf_counter() - start, not the other way round.")
    elif any(t == 0 for t in times):
        hint = ("a time of exactly 0 means nothing happened between the two clock readings: "
                "read the clock once before comm.send and once after comm.recv returns.")
    elif any(t < 0 for t in times):
        hint = ("some times are negative: read `start` anew at the top of every iteration, "
                "before the send, and subtract it from the clock after the receive.")
    elif any(t > 3600 for t in times):
        hint = ("a round trip of hours is a clock reading, not a duration: append "
                "time.perf_counter() - start, with start read just before the send.")
    else:
        return
    raise checks.CheckFailed(f"{where} must be positive durations in seconds, got {times}."
                             f"\nHint: {hint}", exercise=ex)


@checks.check("Exercise 0.2", hidden=lambda rng: _hidden_world(rng, numel=rng.randint(1, 50)))
def check_token_ring(token_ring, world_sizes=(2, 3), numel=7, seed=None):
    ex = "Exercise 0.2"
    token = torch.arange(numel, dtype=torch.float64, device="cpu") if seed is None else \
        _payload(numel, seed).double()
    nbytes = token.numel() * token.element_size()
    for n in world_sizes:
        if seed is None:
            outs = yield on_ranks(counted, token_ring, token, nproc=n)
        else:
            tokens = [token] + [_payload(numel, seed + r).double() for r in range(1, n)]
            outs = yield on_ranks(token_job, token_ring, tokens, nproc=n)
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
    return f"world sizes {list(world_sizes)}, a {numel}-element float64 token"


@checks.check("Exercise 0.3", hidden=lambda rng: _hidden_world(rng, numel=rng.randint(2, 50_000)))
def check_ring_shift(ring_shift, world_sizes=(2, 3), numel=100_003, timeout=30.0, seed=None):
    ex = "Exercise 0.3"
    for n in world_sizes:
        outs = yield on_ranks(shift_job, ring_shift, numel, seed, nproc=n, timeout=timeout)
        for rank, (got, stats) in enumerate(outs):
            left = (rank - 1) % n
            want = _shift_input(left, numel, seed)
            checks.expect_close(ex, got, want, rank=rank, world_size=n,
                                what=f"the tensor received (should be rank {left}'s)",
                                hint="send to (rank + 1) % n, receive from (rank - 1) % n")
            checks.expect_equal(ex, (stats["sent_messages"], stats["recv_messages"]), (1, 1),
                                rank=rank, world_size=n, what="(messages sent, received)",
                                hint="one step is one send and one receive per rank")
    return f"world sizes {list(world_sizes)}, {numel} elements"
