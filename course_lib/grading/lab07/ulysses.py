"""Exercise 7.8's check: Ulysses attention from contiguous sequence shards, forward and
backward, on 1-3 ranks and on a pair inside 3, against dense attention and its gradients
worked out in the checking process (:mod:`.references`); and its traffic: each rank
sends every peer exactly that peer's share of q, k, v and the output (forward) and of
their gradients (backward), nothing gathered whole."""
from __future__ import annotations

import torch

from course_lib.grading import checks, salt
from course_lib.grading.lab07 import jobs, references
from course_lib.grading.lab07.references import group_cases, members
from course_lib.grading.requests import on_ranks

EX_ULYSSES = "Exercise 7.8"


@checks.check(EX_ULYSSES, hidden=salt.draw)
def check_ulysses(ulysses_attention, world_sizes=(1, 2, 3)):
    ex = EX_ULYSSES
    s_local = references.ULYSSES_SHAPE[2]
    for n in world_sizes:
        for where, use_pair in group_cases(n):
            for causal in (True, False) if n == 2 else (True,):
                outs = yield on_ranks(jobs.ulysses_job, ulysses_attention, use_pair, causal,
                                      nproc=n, timeout=30)
                ranks, whole = [], {}  # whole: each group size's dense answer, made once
                for rank in range(n):
                    group = members(n, use_pair, rank)
                    g, me = len(group), group.index(rank)
                    if g not in whole:
                        whole[g] = references.ulysses_expected(g, causal)
                    mine = slice(me * s_local, (me + 1) * s_local)
                    ranks.append((rank, g, me, mine, f"rank {rank} of world size {n} (group = "
                                                     f"{where}, causal={causal})",
                                  [t[..., mine, :] for t in whole[g]]))
                # every rank's output first: rank 0's causal output needs no other rank's
                # keys, so a wrong exchange shows in a later rank's output before any gradient
                for (rank, g, me, mine, say, want), (got, *_) in zip(ranks, outs):
                    checks.expect_close(ex, got, want[0], rank=rank, world_size=n, rtol=1e-9,
                                        atol=1e-9, what=f"the output (group = {where}, "
                                                        f"causal={causal})",
                                        hint=_output_mistake(got, want[0], g, causal, mine))
                for (rank, g, me, mine, say, want), (_, grads, stats, refused) in zip(ranks,
                                                                                      outs):
                    _grade_gradients(ex, say, grads, want[1:], rank, n)
                    _grade_traffic(ex, say, stats, me, g, want[0])
                    if g > 1 and refused is not True:
                        raise checks.CheckFailed(
                            f"{ex}: {say}: called with {5 if g == 2 else 4} heads on {g} "
                            f"ranks, your function "
                            + ("returned" if refused == "returned" else f"raised {refused}")
                            + ": raise a ValueError when the heads do not divide among the "
                              "ranks (before any all-to-all, so that no rank waits)")
    return (f"world sizes {list(world_sizes)} and a pair inside 3, 6 heads, 5 tokens per "
            f"rank, causal and not: output and q, k, v gradients equal dense attention; each "
            f"peer sent its share of the heads, forward and backward; heads that do not "
            f"divide refused")


def _output_mistake(got, want, g, causal, mine):
    """What a wrong output most likely comes from (empty when nothing matches)."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return ("return this rank's shard of the output, shaped like q: (b, H, s/n, d); the "
                "second all-to-all gives every head back to the ranks that own the tokens")

    def close(case):
        return torch.allclose(got, case[0][..., mine, :], rtol=1e-9, atol=1e-9)

    if causal and close(references.ulysses_expected(g, False)):
        return ("that is attention without the causal mask: with the whole sequence of your "
                "heads in hand, pass is_causal=causal to the attention")
    if g > 1 and close(references.ulysses_expected(g, causal, local_only=True)):
        return ("each rank attended only to its own tokens: swap sequence shards for head "
                "shards with an all-to-all first, so that a rank holds every token of H/n heads")
    return ("after the first all-to-all rank r must hold heads r*H/n .. (r+1)*H/n - 1 of every "
            "position, the piece from rank p being positions p*s/n .. (p+1)*s/n - 1, in that "
            "order along the sequence; the second all-to-all must undo the first exactly")


def _grade_gradients(ex, say, grads, want, rank, n):
    if grads is None or any(grad is None for grad in grads):
        raise checks.CheckFailed(
            f"{ex}: {say}: q, k and v got no gradient from the output: an all-to-all into a "
            f"fresh tensor is not recorded by autograd. Wrap each swap in a "
            f"torch.autograd.Function whose backward is the swap the other way")
    for name, got, expected in zip(("q", "k", "v"), grads, want):
        checks.expect_close(ex, got, expected, rank=rank, world_size=n, rtol=1e-9, atol=1e-9,
                            what=f"the gradient of {name} ({say.split(' (', 1)[1]}",
                            hint="an all-to-all into a fresh tensor is invisible to autograd "
                                 "(all but the piece a rank copies to itself), so wrap each "
                                 "swap in a torch.autograd.Function: the backward of "
                                 "sequence -> heads is heads -> sequence "
                                 "applied to the gradient, all-to-all included (the gradient "
                                 "of a head's tokens lives on the rank that computed that "
                                 "head), and the backward of heads -> sequence is "
                                 "sequence -> heads")


def _grade_traffic(ex, say, stats, me, g, out):
    # per peer: its heads of this rank's tokens, of q, k, v and the output (forward) and
    # of their four gradients (backward)
    share = out.numel() // g * out.element_size()
    sent = {int(p): b for p, b in stats["sent_to"].items() if b}
    expected = {p: 8 * share for p in range(g) if p != me}
    if sent != expected:
        raise checks.CheckFailed(
            f"{ex}: {say}: bytes sent to each peer {dict(sorted(sent.items()))}; expected "
            f"{expected}: forward and backward, each of q, k, v and the output sends every "
            f"other rank its 1/n of the heads of this rank's tokens ({share} bytes), nothing "
            f"more, through your all_to_all (or course_lib.collectives.all_to_all) so that it "
            f"is counted")
