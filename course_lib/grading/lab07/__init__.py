"""Checks of Lab 07's exercises: long sequences and many experts.

7.1 (an all-to-all from send/recv with uneven splits) runs the student's function on
1, 2 and 3 ranks and on a pair inside 3, judges every rank's output against the pieces
the check cut itself and the traffic (each piece straight to its rank, nothing to
itself); a blocking send to every peer in turn deadlocks and is stopped with the
launcher's diagnosis of the hang. 7.2 (merge two partial attention results) and 7.7
(token dispatch and combine) call the student's functions in the student's process
against dense attention and a loop serving first choices first. 7.3 (one rank's ring-attention
forward) runs on 1-3 ranks against dense causal attention on the whole sequence, and
counts each rank's floating-point operations (a rank of the contiguous layout computes
only the r + 1 blocks it may see) and its messages (its k and v, n - 1 times, to the
next rank), and checks that the first block's exchange was in flight while the rank
computed. 7.4 (the ring's backward): :mod:`.ring_backward`. 7.5 (the zigzag layout's
positions and pieces): :mod:`.zigzag`. 7.6 (the router and its
balancing loss): :mod:`.router`. 7.7: :mod:`.dispatch`. 7.8 (Ulysses attention, forward
and backward): :mod:`.ulysses`. Predictions 7.1 and 7.2:
:mod:`.predictions`.
"""
from __future__ import annotations

import torch

from course_lib.grading import checks, salt
from course_lib.grading.lab07 import jobs, references
from course_lib.grading.lab07.dispatch import check_dispatch
from course_lib.grading.lab07.predictions import (check_activation_prediction,
                                                  check_traffic_prediction)
from course_lib.grading.lab07.references import group_cases, members
from course_lib.grading.lab07.ring_backward import check_ring_backward
from course_lib.grading.lab07.router import check_router
from course_lib.grading.lab07.ulysses import check_ulysses
from course_lib.grading.lab07.zigzag import check_zigzag
from course_lib.grading.requests import call_each, here, on_ranks

EX_A2A, EX_MERGE, EX_RING = (f"Exercise 7.{i}" for i in range(1, 4))

__all__ = ["check_all_to_all", "check_merge", "check_ring_forward", "check_ring_backward",
           "check_zigzag", "check_router", "check_dispatch", "check_ulysses",
           "check_traffic_prediction",
           "check_activation_prediction"]


# ---- 7.1: all-to-all --------------------------------------------------------------------
@checks.check(EX_A2A, hidden=checks.reseeded)
def check_all_to_all(all_to_all, world_sizes=(1, 2, 3), seed=71):
    ex = EX_A2A
    cases = {g: references.all_to_all_cases(g, seed) for g in (1, 2, 3)}
    for n in world_sizes:
        for where, use_pair in group_cases(n):
            # one request per case: a wrong answer that crashes on uneven splits is then
            # told apart from one that is already wrong on even ones
            for i in range(max(len(cases[g]) for g in (1, 2, 3))):
                by_size = [[]] + [[(s, w, d) for _, s, w, d in cases[g][i:i + 1]]
                                  for g in (1, 2, 3)]
                try:
                    # a case takes well under a second on warm ranks: 15 s is a start on
                    # a busy machine with room to spare, not a wait for a student's deadlock
                    outs = yield on_ranks(jobs.all_to_all_job, all_to_all, use_pair, by_size,
                                          nproc=n, timeout=15)
                except checks.CheckFailed as exc:
                    raise _with_case(exc, cases[n if not use_pair else 2], i) from None
                for rank, results in enumerate(outs):
                    group = members(n, use_pair, rank)
                    for case, (got, stats) in zip(cases[len(group)][i:i + 1], results):
                        _grade_all_to_all(ex, case, got, stats, rank, n, group, where)
    return (f"world sizes {list(world_sizes)} and a pair inside 3: even, uneven and zero-row "
            f"splits, rows and 1-D, float32 and int64; each piece sent straight to its rank")


def _with_case(exc, cases, i):
    """The failure of a case, saying which case it was (and what is special about it)."""
    if i >= len(cases):
        return exc
    label, sends = cases[i][:2]
    hint = f"\nThis was the case with {label}: rows each rank sends each peer {sends}."
    if len({k for row in sends for k in row}) > 1:
        hint += (" The splits are uneven: rank r sends peer p input_splits[p] rows, from "
                 "offset input_splits[0] + ... + input_splits[p-1], and receives "
                 "output_splits[p] rows from p (a piece of 0 rows needs no message).")
    failed = checks.CheckFailed(f"{exc}{hint}", exercise=EX_A2A)
    failed.stacks, failed.diagnosis = getattr(exc, "stacks", None), getattr(exc, "diagnosis", None)
    return failed


def _grade_all_to_all(ex, case, got, stats, rank, n, group, where):
    label, sends, width, dtype = case
    me, g = group.index(rank), len(group)
    say = f"{ex}: rank {rank} of world size {n} (group = {where}), {label}"
    want = references.all_to_all_output(sends, me, width, dtype)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != dtype:
        raise checks.CheckFailed(f"{say}: the output buffer is no longer a {tuple(want.shape)} "
                                 f"{dtype} tensor: fill the output you are given, in place")
    if not torch.equal(got, want):
        raise checks.CheckFailed(f"{say}: wrong output.\n{_diagnose(got, sends, me, width)}")
    sent = {int(p): b for p, b in stats["sent_to"].items() if b}
    row_bytes = (width or 1) * torch.empty((), dtype=dtype).element_size()
    expected = {p: sends[me][p] * row_bytes for p in range(g) if p != me and sends[me][p]}
    if g > 1 and not stats["sent_to"] and not stats["recv_from"] and expected:
        raise checks.CheckFailed(f"{say}: the output is right but no message was counted. "
                                 f"Send with course_lib.comm (comm.exchange, or comm.isend "
                                 f"and comm.irecv), which counts each message")
    if sent != expected:
        raise checks.CheckFailed(
            f"{say}: bytes sent to each peer {dict(sorted(sent.items()))}; expected "
            f"{expected} (input_splits[p] rows of {row_bytes} bytes to each other peer p, "
            f"nothing to yourself: your own piece is a local copy)")


def _diagnose(got, sends, me, width):
    """Where the first wrong piece of rank ``me``'s output came from."""
    at = 0
    for src in range(len(sends)):
        rows = sends[src][me]
        part = got[at:at + rows].reshape(rows, -1)
        want = references.piece(src, me, rows, width, got.dtype).reshape(rows, -1)
        span = f"rows {at}..{at + rows - 1}" if rows else "no rows"
        at += rows
        if torch.equal(part, want):
            continue
        first = part.flatten()[0].item()
        if first < 0 and src == me:
            return (f"Your {span} (your own piece, output_splits[{src}] = {rows} rows) were "
                    f"never written: copy the input rows you cut for yourself into that slice "
                    f"(no message: a rank does not send to itself).")
        if first < 0:
            return (f"Your {span} (rank {src}'s piece, output_splits[{src}] = {rows} rows) were "
                    f"never written. Post a receive from rank {src} into that slice.")
        origin, meant = references.source_of(first), int(first) // 100 % 10
        if origin != src:
            return (f"Your {span} should hold what rank {src} cut for you, but they came from "
                    f"rank {origin}: receive from peer p into the slice at output_splits[0] + "
                    f"... + output_splits[p-1].")
        if meant != me:
            return (f"Your {span} came from rank {src}, but it had cut them for rank {meant}: "
                    f"rank {src} must send each peer p the input_splits[p] rows starting at "
                    f"input_splits[0] + ... + input_splits[p-1] (the splits are uneven: do not "
                    f"cut the input into equal parts).")
        return (f"Your {span} from rank {src} are not the rows it cut for you: expected "
                f"{want.flatten().tolist()}, got {part.flatten().tolist()}.")
    return "the values differ (every piece looked right: is the output's length right?)"


# ---- 7.2: merging two partial results by their log-sum-exp ----------------------------------
@checks.check(EX_MERGE, hidden=checks.reseeded)
def check_merge(merge, seed=0):
    ex = EX_MERGE
    cases = references.merge_cases(seed)
    answers = yield here(call_each, merge, [((oa.clone(), la.clone(), ob.clone(), lb.clone()),
                                             {}) for _, oa, la, ob, lb, _, _ in cases])
    for (label, out_a, lse_a, out_b, lse_b, out, lse), answer in zip(cases, answers):
        got = checks.answer_value(ex, f"merge(...) for {label}", answer)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise checks.CheckFailed(f"{ex}: merge must return (out, lse); for {label} it "
                                     f"returned {type(got).__name__}")
        got_out, got_lse = got
        # float32 log-sum-exps near 300 are only good to 2e-5: a loose tolerance still
        # tells an overflow or an ignored side from rounding
        tol = dict(rtol=1e-4, atol=1e-4) if out.dtype == torch.float32 else {}
        if isinstance(got_out, torch.Tensor) and got_out.shape == out.shape:
            hint = _merge_mistake(got_out, got_lse, out_a, lse_a, out_b, lse_b, out)
        else:
            hint = ""
        checks.expect_close(ex, got_out, out, rank=0, world_size=1, what=f"out, {label}",
                            hint=hint or "o = e^(l_a - l) o_a + e^(l_b - l) o_b with "
                                         "l = log(e^l_a + e^l_b)", **tol)
        checks.expect_close(ex, got_lse, lse, rank=0, world_size=1, what=f"lse, {label}",
                            hint=hint or "l = log(e^l_a + e^l_b): torch.logaddexp", **tol)
    return f"{len(cases)} cases: rows that see no key of a block, batches of heads, large scores"


def _merge_mistake(got, got_lse, out_a, lse_a, out_b, lse_b, out):
    def close(x, y):
        return x.shape == y.shape and torch.allclose(x, y, rtol=1e-4, atol=1e-6)

    if torch.isnan(got).any():
        if torch.isinf(lse_a).any() or torch.isinf(lse_b).any():
            return ("nan where a row's log-sum-exp is -inf (it saw no key of that block): "
                    "exp(-inf - (-inf)) is nan. Such a block must weigh 0")
        return "nan: exp of a large log-sum-exp overflows; subtract the larger one first"
    if torch.isinf(got).any():
        return "inf: exp of a large log-sum-exp overflows; subtract the larger one first"
    if close(got, (out_a + out_b) / 2):
        return ("that is the average of the two: each block must weigh by its share of the "
                "softmax's denominator, e^l_a / (e^l_a + e^l_b)")
    if close(got, out_a + out_b):
        return ("that is o_a + o_b: each is normalised over its own keys only, so each must "
                "be rescaled by e^(l_a - l) and e^(l_b - l)")
    if isinstance(got_lse, torch.Tensor) and close(got_lse, torch.maximum(lse_a, lse_b)):
        return "the new log-sum-exp is log(e^l_a + e^l_b), not max(l_a, l_b)"
    return ""


# ---- 7.3: one rank's ring-attention forward ----------------------------------------------
@checks.check(EX_RING, hidden=salt.draw)
def check_ring_forward(ring_attention_forward, world_sizes=(1, 2, 3)):
    ex = EX_RING
    per_block = references.block_flops()
    for n in world_sizes:
        for where, use_pair in group_cases(n):
            outs = yield on_ranks(jobs.ring_forward_job, ring_attention_forward, use_pair,
                                  nproc=n, timeout=30)
            for rank, (got, stats, flops, overlapped) in enumerate(outs):
                group = members(n, use_pair, rank)
                g, me = len(group), group.index(rank)
                say = f"rank {rank} of world size {n} (group = {where})"
                want = references.ring_expected(g).chunk(g, dim=-2)[me]
                checks.expect_close(ex, got, want, rank=rank, world_size=n, rtol=1e-9,
                                    atol=1e-9, what=f"the attention output (group = {where})",
                                    hint="at step t, rank r holds the k/v block of rank "
                                         "(r - t) mod n; mask only the diagonal block (t = 0); "
                                         "receive the next block into a new buffer, not the "
                                         "one you compute on or send; and your merge must "
                                         "pass Exercise 7.2's check (the ring uses it)")
                _grade_ring_work(ex, say, flops / per_block, me)
                _grade_ring_traffic(ex, say, stats, me, g, want)
                if g > 1 and overlapped is not True:
                    raise checks.CheckFailed(
                        f"{ex}: {say}: " + ("no message went through comm.exchange_async "
                                            "(or comm.isend / comm.irecv)" if overlapped is None
                                            else "nothing was computed while the first block's "
                                                 "exchange was in flight")
                        + ": post the exchange of a step with comm.exchange_async, compute on "
                          "the block you hold, then wait (the send hides under the compute)")
    # (how many times a block travels is Prediction 7.2's bytes: not told here)
    return (f"world sizes {list(world_sizes)} and a pair inside 3, 5 tokens per rank: equal "
            f"to dense causal attention, r + 1 blocks on rank r, k and v passed on to the "
            f"next rank under the compute")


def _grade_ring_work(ex, say, blocks, me):
    """Rank ``me`` of the contiguous layout multiplies its queries with blocks 0..me."""
    if blocks == 0:
        raise checks.CheckFailed(f"{ex}: {say}: no matrix product was counted on this rank: "
                                 f"compute each block with cp.attention_with_lse (or matmuls), "
                                 f"which the check counts")
    if blocks > me + 1.25:
        raise checks.CheckFailed(
            f"{ex}: {say}: your queries were multiplied with {blocks:.1f} key blocks; causal "
            f"attention on the contiguous layout needs only {me + 1} (the blocks of ranks "
            f"0..{me}): skip the blocks of later ranks, every score in them is masked")
    if blocks < me + 0.75:
        raise checks.CheckFailed(f"{ex}: {say}: only {blocks:.1f} blocks' products were "
                                 f"counted; rank {me} needs {me + 1} (q k^T and p v for each)")


def _grade_ring_traffic(ex, say, stats, me, g, want):
    block = 2 * want.numel() * want.element_size()  # this rank's k and v
    sent = {int(p): b for p, b in stats["sent_to"].items() if b}
    expected = {(me + 1) % g: (g - 1) * block} if g > 1 else {}
    if sent != expected:
        raise checks.CheckFailed(
            f"{ex}: {say}: bytes sent to each peer {dict(sorted(sent.items()))}; expected "
            f"{expected}: a k/v block ({block} bytes) to the next rank at each of the "
            f"n - 1 = {g - 1} steps (at the last step there is nothing left to pass on), "
            f"with course_lib.comm so that it is counted")
