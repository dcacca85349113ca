"""Exercise 7.4's check: one rank's ring-attention backward (causal, contiguous layout),
given the saved output and log-sum-exp of the whole attention, on 1-3 ranks and on a pair
inside 3, against dense attention's gradients worked out in the checking process
(:mod:`.references`); the work (rank r multiplies with r + 1 blocks, as in forward) and
the traffic (only to the next rank, the block and its gradients travelling round)."""
from __future__ import annotations

from course_lib.grading import checks, salt
from course_lib.grading.lab07 import jobs, references
from course_lib.grading.lab07.references import group_cases, members
from course_lib.grading.requests import on_ranks

EX_RING_BACKWARD = "Exercise 7.4"


@checks.check(EX_RING_BACKWARD, hidden=salt.draw)
def check_ring_backward(ring_attention_backward, world_sizes=(1, 2, 3)):
    ex = EX_RING_BACKWARD
    per_block = references.block_backward_flops()
    for n in world_sizes:
        for where, use_pair in group_cases(n):
            outs = yield on_ranks(jobs.ring_backward_job, ring_attention_backward, use_pair,
                                  nproc=n, timeout=30)
            ranks, whole = [], {}  # whole: each group size's dense gradients, made once
            for rank, (got, stats, flops) in enumerate(outs):
                group = members(n, use_pair, rank)
                g, me = len(group), group.index(rank)
                say = f"rank {rank} of world size {n} (group = {where})"
                if not (isinstance(got, (tuple, list)) and len(got) == 3):
                    raise checks.CheckFailed(
                        f"{ex}: {say}: expected (dq, dk, dv), three tensors shaped like q, "
                        f"got {type(got).__name__}")
                if g not in whole:
                    whole[g] = references.ring_gradients(g)
                want = [t.chunk(g, dim=-2)[me] for t in whole[g]]
                ranks.append((rank, g, me, say, got, want, stats, flops))
            # dq of every rank first: it needs no travelling gradient, so a wrong P or D
            # shows there (rank 0 sees its own block only, where most mistakes vanish)
            for i, (name, hint) in enumerate(zip(("dq", "dk", "dv"), HINTS)):
                for rank, g, me, say, got, want, _, _ in ranks:
                    checks.expect_close(ex, got[i], want[i], rank=rank, world_size=n,
                                        rtol=1e-9, atol=1e-9, what=f"{name} (group = {where})",
                                        hint=hint)
            for rank, g, me, say, got, want, stats, flops in ranks:
                _grade_work(ex, say, flops / per_block, me, g)
                _grade_traffic(ex, say, stats, me, g, want[1])
    return (f"world sizes {list(world_sizes)} and a pair inside 3, 5 tokens per rank: dq, dk, "
            f"dv equal dense causal attention's gradients, each block's gradients home on its "
            f"rank, later ranks' blocks skipped, only the next rank sent to")


HINTS = (
    "dq sums dS_j K_j / sqrt(d) over the blocks this rank's queries see, with "
    "P_j = exp(q K_j^T / sqrt(d) - lse) from the saved lse and dS_j = P_j * (dO V_j^T - D), "
    "D = rowsum(dO * O) from the saved output (not a block's partial output)",
    "dK_j = dS_j^T q / sqrt(d) is owed to block j's owner by every rank whose queries see "
    "it: let the gradient travel with (or behind) the block and end on its owner after "
    "the last step, each rank adding its share on the way",
    "dV_j = P_j^T dO, summed over every rank whose queries see block j, like dK_j: it must "
    "end on block j's owner",
)


def _grade_work(ex, say, blocks, me, g):
    """Rank ``me`` multiplies with blocks 0..me: five products each (scores, dV, dP, dQ,
    dK). A little more is allowed; a block of a later rank is not."""
    if blocks == 0:
        raise checks.CheckFailed(f"{ex}: {say}: no matrix product was counted on this rank: "
                                 f"compute each block's products with @ (or torch.matmul), "
                                 f"which the check counts")
    if g > 1 and blocks > 1.3 * (me + 1) + 0.2:
        raise checks.CheckFailed(
            f"{ex}: {say}: your products add up to {blocks:.1f} blocks' worth (five products "
            f"per block); causal attention on the contiguous layout needs the blocks of ranks "
            f"0..{me} only: skip a block whose every score is masked, in backward as in "
            f"forward")


def _grade_traffic(ex, say, stats, me, g, chunk):
    kv = 2 * chunk.numel() * chunk.element_size()  # this rank's k and v
    sent = {int(p): b for p, b in stats["sent_to"].items() if b}
    others = sorted(p for p in sent if p != (me + 1) % g)
    if g > 1 and (others or not sent):
        raise checks.CheckFailed(
            f"{ex}: {say}: bytes sent to each peer {dict(sorted(sent.items()))}: a ring "
            f"sends only to the next rank, {(me + 1) % g}, through course_lib.comm (so that "
            f"it is counted)")
    total = sum(sent.values())
    if total > 2 * g * kv:
        raise checks.CheckFailed(
            f"{ex}: {say}: {total} bytes sent, more than {2 * g * kv}: the k/v block and its "
            f"two gradients ({kv} bytes each pair) need only go round once, n = {g} steps at most")
