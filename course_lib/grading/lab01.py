"""Checks of Lab 01's exercises: collectives from send/recv.

Each runs the student's collective on world sizes 1-3 with sizes that do not
divide evenly, compares every rank's result with torch's built-in computed in
the same job, and grades the traffic: a ring all-reduce that moves the whole
tensor at every step gives the right numbers but fails here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.grading import checks
from course_lib.runtime.backend import builtin_all_gather, builtin_reduce_scatter

SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX
WHOLE_TENSOR_HINT = ("your rank sends far more than a ring should: the whole tensor seems to "
                     "travel at every step. Split it into world_size chunks and send one "
                     "chunk per step.")


def _inputs(numel, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-100, 100, (numel,), generator=gen)
    return torch.randn(numel, generator=gen, dtype=dtype)


def _cases(sizes, dtypes=(torch.float32, torch.int64), ops=(SUM, MAX)):
    return [(n, dt, op) for n in sizes for dt in dtypes for op in ops]


def _all_reduce_job(fn, cases):
    rank = dist.get_rank()
    out = []
    for i, (numel, dtype, op) in enumerate(cases):
        x = _inputs(numel, dtype, 100 * i + rank)
        want = x.clone()
        dist.all_reduce(want, op=op)
        got = x.clone()
        with comm.counting() as stats:
            fn(got, op)
        out.append((got, want, stats.as_dict()))
    return out


def _grade_all_reduce(ex, fn, world_sizes, sizes, traffic):
    cases = _cases(sizes)
    for n in world_sizes:
        outs = checks.launch(ex, _all_reduce_job, fn, cases, nproc=n)
        for rank, per_case in enumerate(outs):
            for (numel, dtype, op), (got, want, stats) in zip(cases, per_case):
                what = f"the result for {numel} elements of {dtype}, op {op}"
                checks.expect_close(ex, got, want, rank=rank, world_size=n, what=what,
                                    rtol=1e-5, atol=1e-5 * n)
                traffic(ex, rank, n, numel, got.element_size(), stats)
    checks.passed(ex, f"world sizes {list(world_sizes)}, sizes {sizes}, SUM and MAX, "
                      "float32 and int64")


def check_naive_all_reduce(fn, world_sizes=(1, 2, 3), sizes=(1, 7, 1001)):
    def traffic(ex, rank, n, numel, elsize, stats):
        want = (n - 1) if rank == 0 else (1 if n > 1 else 0)
        checks.expect_equal(ex, (stats["sent_messages"], stats["recv_messages"]), (want, want),
                            rank=rank, world_size=n, what="(messages sent, received)",
                            hint="every other rank sends its tensor to rank 0 and receives "
                                 "the result back; rank 0 receives n-1 and sends n-1")

    _grade_all_reduce("Exercise 1.1", fn, world_sizes, sizes, traffic)


def _rs_ag_job(fn, kind, cases):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for i, (numel, dtype, op) in enumerate(cases):
        if kind == "reduce_scatter":
            inp = _inputs(world * numel, dtype, 100 * i + rank)
            got, want = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
            builtin_reduce_scatter(want, inp, op=op)
            with comm.counting() as stats:
                fn(got, inp, op)
        else:
            inp = _inputs(numel, dtype, 100 * i + rank)
            got = torch.empty(world * numel, dtype=dtype)
            want = torch.empty(world * numel, dtype=dtype)
            builtin_all_gather(want, inp)
            with comm.counting() as stats:
                fn(got, inp)
        out.append((got, want, stats.as_dict()))
    return out


def _grade_rs_ag(ex, fn, kind, world_sizes, sizes):
    ops = (SUM, MAX) if kind == "reduce_scatter" else (SUM,)
    cases = _cases(sizes, ops=ops)
    for n in world_sizes:
        outs = checks.launch(ex, _rs_ag_job, fn, kind, cases, nproc=n)
        for rank, per_case in enumerate(outs):
            for (numel, dtype, op), (got, want, stats) in zip(cases, per_case):
                label = f"op {op}" if kind == "reduce_scatter" else ""
                checks.expect_close(ex, got, want, rank=rank, world_size=n, rtol=1e-5,
                                    atol=1e-5 * n,
                                    what=f"the output for chunks of {numel} {dtype} {label}")
                chunk_bytes = numel * got.element_size()
                checks.expect_equal(
                    ex, (stats["sent_messages"], stats["sent_bytes"]),
                    ((n - 1), (n - 1) * chunk_bytes), rank=rank, world_size=n,
                    what="(messages sent, bytes sent)",
                    hint=f"a ring {kind.replace('_', '-')} takes n-1 steps, each sending one "
                         f"chunk (1/n of the array) to the right neighbour")
    checks.passed(ex, f"world sizes {list(world_sizes)}, chunks of {sizes} elements")


def check_ring_reduce_scatter(fn, world_sizes=(1, 2, 3), sizes=(1, 7, 250)):
    _grade_rs_ag("Exercise 1.2", fn, "reduce_scatter", world_sizes, sizes)


def check_ring_all_gather(fn, world_sizes=(1, 2, 3), sizes=(1, 7, 250)):
    _grade_rs_ag("Exercise 1.3", fn, "all_gather", world_sizes, sizes)


def check_ring_all_reduce(fn, world_sizes=(1, 2, 3), sizes=(1, 7, 1001)):
    def traffic(ex, rank, n, numel, elsize, stats):
        if n == 1:
            return checks.expect_equal(ex, stats["sent_messages"], 0, rank=rank, world_size=1,
                                       what="messages sent", hint="one rank has no one to talk to")
        nbytes = numel * elsize
        # 2(n-1) chunks of ceil(N/n) elements: padding to a multiple of n is allowed
        ring_bytes = 2 * (n - 1) * -(-numel // n) * elsize
        if stats["sent_bytes"] > ring_bytes:
            hint = WHOLE_TENSOR_HINT if stats["sent_bytes"] >= (n - 1) * nbytes else (
                "each of the 2(n-1) messages should carry one chunk of about N/n bytes")
            raise checks.CheckFailed(
                f"{ex}: rank {rank} of world size {n} sent {stats['sent_bytes']} bytes for a "
                f"{nbytes}-byte tensor; a ring sends 2(n-1)/n of it, at most {ring_bytes}."
                f"\nHint: {hint}")
        if numel >= n:  # with fewer elements than ranks, empty chunks may be skipped
            checks.expect_equal(ex, stats["sent_messages"], 2 * (n - 1), rank=rank,
                                world_size=n, what="messages sent",
                                hint="reduce-scatter (n-1 steps) then all-gather (n-1 steps)")

    _grade_all_reduce("Exercise 1.4", fn, world_sizes, sizes, traffic)


def _broadcast_job(fn, cases):
    rank = dist.get_rank()
    out = []
    for i, (numel, src, segments) in enumerate(cases):
        x = torch.arange(numel, dtype=torch.float32) + 1000 * rank
        want = x.clone()
        dist.broadcast(want, src)
        with comm.counting() as stats:
            fn(x, src, segments)
        out.append((x, want, stats.as_dict()))
    return out


def check_pipelined_broadcast(fn, world_sizes=(1, 2, 3, 4), sizes=(1, 10, 1001)):
    ex = "Exercise 1.5"
    for n in world_sizes:
        cases = [(numel, src, seg) for numel in sizes for src in sorted({0, n - 1})
                 for seg in (1, 4)]
        outs = checks.launch(ex, _broadcast_job, fn, cases, nproc=n)
        for rank, per_case in enumerate(outs):
            for (numel, src, seg), (got, want, stats) in zip(cases, per_case):
                checks.expect_close(ex, got, want, rank=rank, world_size=n,
                                    what=f"the tensor after broadcasting {numel} elements from "
                                         f"rank {src} in {seg} segment(s)")
                if numel < seg:
                    continue  # whether empty segments are sent is up to you
                pos = (rank - src) % n
                want_msgs = (seg if pos < n - 1 else 0, seg if pos > 0 else 0)
                checks.expect_equal(ex, (stats["sent_messages"], stats["recv_messages"]),
                                    want_msgs if n > 1 else (0, 0), rank=rank, world_size=n,
                                    what=f"(messages sent, received) with src={src}, S={seg}",
                                    hint="each rank receives every segment from its left "
                                         "neighbour and forwards it right, except the last "
                                         "rank of the chain, (src - 1) % n")
    checks.passed(ex, f"world sizes {list(world_sizes)}, sizes {sizes}, 1 and 4 segments")
