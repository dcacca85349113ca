"""Exercise 1.6, from a blank page: an all-reduce that picks the star or the ring by size.

The student writes ``choose_all_reduce(n_bytes, k, alpha, bandwidth)`` (graded on many
settings, in their process, against :func:`~course_lib.collectives.choose_all_reduce`)
and ``adaptive_all_reduce(tensor, op, alpha, bandwidth)``, which runs their own star
(every message of a phase posted at once) or their own ring. That one runs on K = 3 and
4 gloo ranks with sizes on both sides of the crossover N* = (K-2) K alpha B / (K-1)^2:
every rank's result against the reduction the check computes, and the traffic says
which algorithm ran (a star's root: K-1 messages in one exchange per phase; a ring
rank: 2(K-1) messages of about N/K, only to its right neighbour).
"""
from __future__ import annotations

import torch

from course_lib.collectives.cost_model import choose_all_reduce as formula_choice
from course_lib.collectives.cost_model import (ring_all_reduce_time, star_all_reduce_time,
                                              star_ring_crossover)
from course_lib.grading import checks, salt
from course_lib.grading.lab01 import jobs, messages, references
from course_lib.grading.lab01.references import MAX, SUM
from course_lib.grading.requests import call_each, here, on_ranks

# alpha = 1 ms, B = 1 MB/s: N* is 750 bytes on 3 ranks, 889 on 4, on the ranks below
ALPHA, BANDWIDTH = 1e-3, 1e6
RANK_SIZES = (7, 150, 250, 1001)  # float32: 28, 600, 1000 and 4004 bytes
CHOICE_CASES = [(n, k, a, b) for (a, b) in ((20e-6, 10e9), (3e-6, 450e9), (1e-3, 1e6))
                for k in (2, 3, 8, 64)
                for n in (1, 1024, 1 << 20, 1 << 30)]
CHOICE_CASES += [(round(star_ring_crossover(k, 3e-6, 450e9) * f), k, 3e-6, 450e9)
                 for k in (3, 8) for f in (0.9, 1.1)]


def _times(n, k, a, b):
    return (f"the star takes {star_all_reduce_time(n, k, a, b) * 1e6:.4g} us, "
            f"the ring {ring_all_reduce_time(n, k, a, b) * 1e6:.4g} us")


def _grade_choices(ex, answers):
    for (n, k, a, b), answer in zip(CHOICE_CASES, answers):
        call = f"choose_all_reduce({n:,}, {k}, alpha={a:g}, bandwidth={b:g})"
        if "raised" in answer:
            raise checks.CheckFailed(f"{ex}: {call} raised {answer['raised']}: "
                                     f"{answer['message']}", exercise=ex)
        got, want = answer["value"], formula_choice(n, k, a, b)
        if got == want:
            continue
        if got not in ("star", "ring"):
            why = 'return "star" or "ring"'
        elif k == 2:
            why = ("on two ranks both pay two rounds of latency, and each ring message "
                   "carries N/2 where the star's carry N: the ring never loses")
        elif want == "star":
            why = ("small messages are all latency: the star pays it twice, once per phase, "
                   "the ring 2(K-1) times")
        else:
            why = ("the star's root link carries K-1 whole messages each way; the ring's "
                   "links carry 2(K-1)/K of one: above N* = (K-2) K alpha B / (K-1)^2 that "
                   "outweighs the latency")
        raise checks.CheckFailed(f"{ex}: {call} returned {got!r}; it is {want!r} "
                                 f"({_times(n, k, a, b)}).\nHint: {why}.")


def _ran(stats, rank, k):
    """"star", "ring" or a description, from one rank's traffic."""
    if rank == 0 and stats["sent_messages"] == k - 1 and stats["recv_messages"] == k - 1:
        return "star" if stats["exchanges"] <= 2 else "naive, one message at a time"
    if rank != 0 and stats["sent_messages"] == 1 and set(stats["sent_to"]) == {0}:
        return "star"
    if stats["sent_messages"] == 2 * (k - 1) and set(stats["sent_to"]) == {(rank + 1) % k}:
        return "ring"
    return f"{stats['sent_messages']} messages to ranks {sorted(stats['sent_to'])}"


@checks.check("Exercise 1.6", hidden=salt.draw)
def check_adaptive_all_reduce(choose_all_reduce, adaptive_all_reduce, world_sizes=(3, 4)):
    ex = "Exercise 1.6"
    answers = yield here(call_each, choose_all_reduce, [(c, {}) for c in CHOICE_CASES])
    _grade_choices(ex, answers)
    cases = [(n, torch.float32, op, False) for n in RANK_SIZES for op in (SUM, MAX)]
    for k in world_sizes:
        inputs = references.inputs_of(cases, k)
        outs = yield on_ranks(jobs.adaptive_job, adaptive_all_reduce,
                              [(ins, op) for ins, (_, _, op, _) in zip(inputs, cases)],
                              ALPHA, BANDWIDTH, nproc=k)
        for (numel, dtype, op, _), ins, per_rank in zip(cases, inputs, zip(*outs)):
            nbytes = numel * 4
            want_algorithm = formula_choice(nbytes, k, ALPHA, BANDWIDTH)
            want = references.all_reduce_result(ins, op)
            what = "the result for " + messages.describe_case(numel, dtype, op, False, "")
            for rank, (got, stats) in enumerate(per_rank):
                checks.expect_close(ex, got, want, rank=rank, world_size=k, what=what,
                                    rtol=1e-5, atol=1e-5 * k)
                ran = _ran(stats, rank, k)
                if ran == want_algorithm:
                    continue
                hint = ("post the root's K-1 receives in one comm.exchange, and its K-1 "
                        "sends in another: the star's point is two rounds of latency, not "
                        "2(K-1)") if ran.startswith("naive") else (
                        "choose with your choose_all_reduce(tensor's bytes, world size, "
                        "alpha, bandwidth), then run your star or your ring")
                raise checks.CheckFailed(
                    f"{ex}: an all-reduce of {nbytes} bytes on {k} ranks with alpha = "
                    f"{ALPHA:g} s and B = {BANDWIDTH:g} B/s should run the {want_algorithm} "
                    f"({_times(nbytes, k, ALPHA, BANDWIDTH)}); rank {rank}'s traffic says: "
                    f"{ran}.\nHint: {hint}.")
    return (f"{len(CHOICE_CASES)} choices; world sizes {list(world_sizes)}, "
            f"{len(RANK_SIZES)} sizes on both sides of N*, SUM and MAX")
