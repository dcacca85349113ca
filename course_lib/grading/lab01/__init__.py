"""Checks of Lab 01's exercises: collectives from send/recv.

Each runs the student's collective on world sizes 1-3 with sizes that do not
divide evenly, compares every rank's result with what the check works out
itself from the inputs it chose, and grades the traffic: how many messages and
bytes, and to whom (a ring talks only to its neighbours). A ring all-reduce
that moves the whole tensor at every step gives the right numbers but fails
here, and so does a "pipelined" broadcast that forwards nothing until it holds
the whole tensor.

The first case of every check is small and patterned, so that a failure shows
where each number came from (element j of chunk c on rank i is 100c + 10i + j);
a wrong answer is diagnosed against the likely mistakes (an ignored ``op``, a
chunk off by one, a rank left out) and the hint says which one it looks like.

Files: :mod:`~course_lib.grading.lab01.jobs` (what runs on the student's ranks:
their code, and a report), :mod:`~course_lib.grading.lab01.references` (the
inputs, and the results they should give), :mod:`~course_lib.grading.lab01.messages`
(hints and diagnoses); the checks below tie them together.
:mod:`~course_lib.grading.lab01.predictions` grades Predictions 1.1 and 1.2,
:mod:`~course_lib.grading.lab01.adaptive` Exercise 1.6 (star or ring, by size).
"""
from __future__ import annotations

from course_lib.grading import checks
from course_lib.grading.lab01 import jobs, messages, references
from course_lib.grading.lab01.adaptive import check_adaptive_all_reduce
from course_lib.grading.lab01.predictions import (check_bytes_prediction,
                                                  check_ring_time_prediction)
from course_lib.grading.lab01.references import MAX, SUM
from course_lib.grading.requests import on_ranks

__all__ = ["check_naive_all_reduce", "check_ring_reduce_scatter", "check_ring_all_gather",
           "check_ring_all_reduce", "check_pipelined_broadcast", "check_bytes_prediction",
           "check_ring_time_prediction", "check_adaptive_all_reduce"]


# ---- comparing, with the hint worked out only on a failure -----------------------------------
def _expect_values(ex, got, want, *, rank, n, what, hint):
    """``checks.expect_close``, with the hint worked out only when the values are
    wrong (``hint`` is a function returning text)."""
    try:
        checks.expect_close(ex, got, want, rank=rank, world_size=n, what=what,
                            rtol=1e-5, atol=1e-5 * n)
    except checks.CheckFailed as exc:
        raise checks.CheckFailed(f"{exc}\nHint: {hint()}") from None


def _expect_peers(ex, stats, *, rank, n, sent, received, hint):
    """Where the bytes went: the set of peers this rank sent to and received from."""
    for what, key, want in (("sent to", "sent_to", sent), ("received from", "recv_from", received)):
        per_peer = stats[key]
        if set(per_peer) != set(want):
            raise checks.CheckFailed(
                f"{ex}: rank {rank} of world size {n} {what} ranks {sorted(per_peer)} "
                f"(bytes per rank: {dict(sorted(per_peer.items()))}); expected "
                f"{sorted(want) if want else 'no one'}."
                f"\nHint: {hint(what, set(per_peer), rank, n)}")


def _hidden(rng):
    """The gradebook's hidden settings: one more world size and a size not in the notebook."""
    return {"world_sizes": (rng.randint(2, 4),), "sizes": (rng.randint(2, 3000),)}


# ---- all-reduce: Exercises 1.1 and 1.4 -----------------------------------------------------
def _grade_all_reduce(ex, fn, world_sizes, sizes, traffic, hint):
    cases = references.cases(sizes)
    for n in world_sizes:
        inputs = references.inputs_of(cases, n)
        outs = yield on_ranks(jobs.all_reduce_job, fn,
                              [(ins, op) for ins, (_, _, op, _) in zip(inputs, cases)], nproc=n)
        for case, ins, per_rank in zip(cases, inputs, zip(*outs)):
            numel, dtype, op, patterned = case
            want = references.all_reduce_result(ins, op)
            what = "the result for " + messages.describe_case(numel, dtype, op, patterned,
                                                              "element j on rank i is 10i + j")
            for rank, (got, stats) in enumerate(per_rank):
                _expect_values(ex, got, want, rank=rank, n=n, what=what,
                               hint=lambda: messages.diagnose_all_reduce(got, op, rank, ins, hint))
                traffic(ex, rank, n, numel, got.element_size(), stats)
    return f"world sizes {list(world_sizes)}, sizes {sizes}, SUM and MAX, int64 and float32"


def _naive_traffic(ex, rank, n, numel, elsize, stats):
    others = set(range(1, n)) if rank == 0 else ({0} if n > 1 else set())
    _expect_peers(ex, stats, rank=rank, n=n, sent=others, received=others,
                  hint=lambda *_: messages.NAIVE_PEERS_HINT)
    want = len(others)
    checks.expect_equal(ex, (stats["sent_messages"], stats["recv_messages"]), (want, want),
                        rank=rank, world_size=n, what="(messages sent, received)",
                        hint=messages.NAIVE_MESSAGES_HINT)


@checks.check("Exercise 1.1", hidden=_hidden)
def check_naive_all_reduce(fn, world_sizes=(1, 2, 3), sizes=(1, 7, 1001)):
    return (yield from _grade_all_reduce("Exercise 1.1", fn, world_sizes, sizes,
                                         _naive_traffic, messages.NAIVE_HINT))


def _ring_traffic(ex, rank, n, numel, elsize, stats):
    if n == 1:
        return checks.expect_equal(ex, stats["sent_messages"], 0, rank=rank, world_size=1,
                                   what="messages sent", hint="one rank has no one to talk to")
    nbytes = numel * elsize
    # 2(n-1) chunks of ceil(N/n) elements: padding to a multiple of n is allowed
    ring_bytes = 2 * (n - 1) * -(-numel // n) * elsize
    if stats["sent_bytes"] > ring_bytes:
        hint = messages.WHOLE_TENSOR_HINT if stats["sent_bytes"] >= (n - 1) * nbytes else \
            messages.RING_CHUNK_BYTES_HINT
        raise checks.CheckFailed(
            f"{ex}: rank {rank} of world size {n} sent {stats['sent_bytes']} bytes for a "
            f"{nbytes}-byte tensor; a ring sends 2(n-1)/n of it, at most {ring_bytes}."
            f"\nHint: {hint}")
    right, left = (rank + 1) % n, (rank - 1) % n
    # with fewer elements than ranks, empty chunks may be skipped
    _expect_peers(ex, stats, rank=rank, n=n, hint=messages.ring_peer_hint("all-reduce"),
                  sent={right} if stats["sent_to"] or numel >= n else set(),
                  received={left} if stats["recv_from"] or numel >= n else set())
    if numel >= n:
        checks.expect_equal(ex, stats["sent_messages"], 2 * (n - 1), rank=rank,
                            world_size=n, what="messages sent",
                            hint=messages.RING_MESSAGES_HINT)


@checks.check("Exercise 1.4", hidden=_hidden)
def check_ring_all_reduce(fn, world_sizes=(1, 2, 3), sizes=(1, 7, 1001)):
    return (yield from _grade_all_reduce("Exercise 1.4", fn, world_sizes, sizes,
                                         _ring_traffic, messages.RING_ALL_REDUCE_HINT))


# ---- reduce-scatter and all-gather: Exercises 1.2 and 1.3 ----------------------------------
def _grade_rs_ag(ex, fn, kind, world_sizes, sizes):
    scatter = kind == "reduce_scatter"
    cases = references.cases(sizes, ops=(SUM, MAX) if scatter else (None,))
    name = kind.replace("_", "-")
    peer_hint = messages.ring_peer_hint(name)
    pattern = ("element j of chunk c on rank i is 100c + 10i + j" if scatter
               else "element j on rank i is 10i + j")
    for n in world_sizes:
        inputs = references.inputs_of(cases, n, chunks=n if scatter else 1)
        fills = [references.output_fill(patterned) for _, _, _, patterned in cases]
        if scatter:
            outs = yield on_ranks(jobs.reduce_scatter_job, fn,
                                  [(ins, op, numel, fill) for ins, (numel, _, op, _), fill
                                   in zip(inputs, cases, fills)], nproc=n)
        else:
            outs = yield on_ranks(jobs.all_gather_job, fn, list(zip(inputs, fills)), nproc=n)
        for case, ins, per_rank in zip(cases, inputs, zip(*outs)):
            numel, dtype, op, patterned = case
            what = "the output for chunks of " + messages.describe_case(numel, dtype, op,
                                                                        patterned, pattern)
            wants = references.reduce_scatter_results(ins, op, numel) if scatter else \
                [references.all_gather_result(ins)] * n
            for rank, (got, stats) in enumerate(per_rank):
                right, left = (rank + 1) % n, (rank - 1) % n
                _expect_peers(ex, stats, rank=rank, n=n, hint=peer_hint,
                              sent={right} if n > 1 else set(),
                              received={left} if n > 1 else set())
                if scatter:
                    def hint():
                        return messages.diagnose_reduce_scatter(got, ins, op, rank, numel)
                else:
                    def hint():
                        return messages.diagnose_all_gather(got, wants[rank], n, numel)
                _expect_values(ex, got, wants[rank], rank=rank, n=n, what=what, hint=hint)
                chunk_bytes = numel * got.element_size()
                checks.expect_equal(
                    ex, (stats["sent_messages"], stats["sent_bytes"]),
                    ((n - 1), (n - 1) * chunk_bytes), rank=rank, world_size=n,
                    what="(messages sent, bytes sent)",
                    hint=f"a ring {name} takes n-1 steps, each sending one chunk (1/n of the "
                         f"array) to the right neighbour")
    return (f"world sizes {list(world_sizes)}, chunks of {sizes} elements, "
            "to the right neighbour only")


@checks.check("Exercise 1.2", hidden=_hidden)
def check_ring_reduce_scatter(fn, world_sizes=(1, 2, 3), sizes=(1, 7, 250)):
    return (yield from _grade_rs_ag("Exercise 1.2", fn, "reduce_scatter", world_sizes, sizes))


@checks.check("Exercise 1.3", hidden=_hidden)
def check_ring_all_gather(fn, world_sizes=(1, 2, 3), sizes=(1, 7, 250)):
    return (yield from _grade_rs_ag("Exercise 1.3", fn, "all_gather", world_sizes, sizes))


# ---- pipelined broadcast: Exercise 1.5 -----------------------------------------------------
@checks.check("Exercise 1.5", hidden=_hidden)
def check_pipelined_broadcast(fn, world_sizes=(1, 2, 3, 4), sizes=(1, 10, 1001)):
    ex = "Exercise 1.5"
    for n in world_sizes:
        cases = references.broadcast_cases(n, sizes)
        inputs = [[references.broadcast_input(q, numel) for q in range(n)]
                  for numel, _, _ in cases]
        outs = yield on_ranks(jobs.broadcast_job, fn,
                              [(ins, src, seg) for ins, (_, src, seg) in zip(inputs, cases)],
                              nproc=n)
        for (numel, src, seg), ins, per_rank in zip(cases, inputs, zip(*outs)):
            # values on every rank first: a wrong value says more about the mistake
            # than the message counts it causes on another rank
            for rank, (got, _, _) in enumerate(per_rank):
                _expect_values(ex, got, ins[src], rank=rank, n=n,
                               hint=lambda: messages.diagnose_broadcast(got, ins, src, seg, rank),
                               what=f"the tensor after broadcasting {numel} elements from "
                                    f"rank {src} in {seg} segment(s) (before it, rank i "
                                    f"held 1000i + j)")
            for rank, (got, stats, events) in enumerate(per_rank):
                _expect_chain(ex, stats, events, rank=rank, n=n, numel=numel, src=src, seg=seg)
    return (f"world sizes {list(world_sizes)}, sizes {sizes}, 1 and 4 segments, "
            "each segment forwarded before the next arrives")


def _expect_chain(ex, stats, events, *, rank, n, numel, src, seg):
    """One rank's part of a chain broadcast: whom it talked to, how many messages, and
    (in the middle of the chain) each segment forwarded before the next arrived."""
    pos = (rank - src) % n
    if n > 1:
        _expect_peers(ex, stats, rank=rank, n=n, hint=lambda *_: messages.CHAIN_PEERS_HINT,
                      sent={(rank + 1) % n} if pos < n - 1 else set(),
                      received={(rank - 1) % n} if pos > 0 else set())
    if numel < seg:
        return  # whether empty segments are sent is up to you
    want_msgs = (seg if pos < n - 1 else 0, seg if pos > 0 else 0)
    checks.expect_equal(ex, (stats["sent_messages"], stats["recv_messages"]),
                        want_msgs if n > 1 else (0, 0), rank=rank, world_size=n,
                        what=f"(messages sent, received) with src={src}, S={seg}",
                        hint=messages.CHAIN_MESSAGES_HINT)
    if 0 < pos < n - 1:
        what = messages.held_back(events, seg)
        if what:
            raise checks.CheckFailed(
                f"{ex}: rank {rank} of world size {n} (position {pos} of the chain from "
                f"src={src}, S={seg}) {what}. Order of its messages: {' '.join(events)}."
                f"\nHint: {messages.PIPELINE_HINT}")
