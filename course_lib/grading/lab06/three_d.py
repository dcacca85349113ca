"""Exercise 6.4, from a blank page: one training run of DP x TP x PP at once.

The student's ``train_3d(cfg, dp, tp, pp, batches)`` runs on every rank of a
``dp * tp * pp`` job (8 gloo ranks as 2 x 2 x 2 here, and 2 x 1 x 2 and 1 x 2 x 2 on
4): it builds this rank's pipeline stage, makes its blocks tensor parallel, averages
gradients over its data-parallel group, feeds the pipeline its replica's rows, and
returns the loss its replica computed at each step (on the last stage; anything on
the others). The judge replays one process on the whole batch and computes, before
each of its updates, every replica's loss on that replica's rows: a rank of the last
stage must report exactly its replica's. The first step's loss says whether the rank
read the right rows; the later ones whether the update was the whole batch's.

The losses alone would pass a run in which every rank trains the whole model on the
whole batch and reports its replica's rows. So each rank's matmul FLOPs are counted
too on the first mesh, against 1/(dp tp pp) of one process's (a stage of a replica,
split over its tp group: 0.7 to 0.9 of that share, the head being whole; 1.25 is the
most allowed), and with pp > 1 every rank must send to and receive from its pipeline
neighbours.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from course_lib.grading import checks, salt, wire
from course_lib.grading.requests import on_ranks
from course_lib.models import GPT
from course_lib.pipeline.runs import corpus_batches, corpus_config, gpt_loss

EX = "Exercise 6.4"
CFG = corpus_config(layers=2, dim=32, heads=4, seq_len=16)
STEPS, BATCH, LR = 3, 8, 3e-3
MESHES = [(2, 2, 2), (1, 2, 2), (2, 1, 2)]  # (dp, tp, pp): all three, then each pair with pp
MOST_FLOPS = 1.25  # of a rank's share, 1/(dp tp pp) of one process's run


def three_d_job(train_3d, cfg, dp, tp, pp, steps, batch, count=False):
    """On a rank: the student's run and where this rank sits, {"losses", "rank"}; with
    ``count``, its matmul FLOPs and its traffic too ("flops", "traffic")."""
    batches = list(corpus_batches(cfg, batch, steps, "cpu"))
    if not count:
        return {"losses": _floats(train_3d(cfg, dp, tp, pp, batches)), "rank": dist.get_rank()}
    with wire.counting() as stats, FlopCounterMode(display=False) as flops:
        losses = train_3d(cfg, dp, tp, pp, batches)
    return {"losses": _floats(losses), "rank": dist.get_rank(), "flops": flops.get_total_flops(),
            "traffic": stats.as_dict()}


def _floats(losses):
    try:
        return [None if v is None else float(v) for v in losses]
    except (TypeError, ValueError):
        return repr(losses)[:200]


def replica_losses(cfg, dp, steps, batch, seed=0, lr=LR):
    """[step][replica]: one process trains GPT(cfg, seed) with AdamW on the whole
    batch; before each update, the mean loss on each replica's rows."""
    model = GPT(cfg, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn, out, size = gpt_loss(cfg.vocab), [], batch // dp
    for x, y in corpus_batches(cfg, batch, steps, "cpu"):
        with torch.no_grad():
            out.append([loss_fn(model(x[d * size:(d + 1) * size]), y[d * size:(d + 1) * size])
                        .item() for d in range(dp)])
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    return out


@functools.lru_cache(maxsize=None)
def one_process_flops(cfg, steps, batch):
    """The matmul FLOPs of :func:`replica_losses` with one replica: the whole run's."""
    with FlopCounterMode(display=False) as flops:
        replica_losses(cfg, 1, steps, batch)
    return flops.get_total_flops()


def _judge_work(outs, total, dp, tp, pp):
    """Each rank did its share of the work, and a pipeline's ranks talked to each other."""
    mesh, n = f"dp={dp} tp={tp} pp={pp}", dp * tp * pp
    for out in outs:
        rank, share = out["rank"], out["flops"] / (total / n)
        if share > MOST_FLOPS:
            raise checks.CheckFailed(
                f"{EX}: on {mesh}, rank {rank} did {share:.1f}x its share of the matmul FLOPs "
                f"(one process's run / {n}); a rank of a 3D run computes only its pipeline "
                f"stage, of its replica's rows, split over its tensor-parallel group.\nHint: "
                f"build stage pp_i of the model (gpt_stage), parallelize its blocks over the "
                f"tp group, and feed the pipeline the rows of replica dp_i only.", exercise=EX)
        traffic = out["traffic"]
        if pp > 1 and not (traffic["sent_messages"] and traffic["recv_messages"]):
            raise checks.CheckFailed(
                f"{EX}: on {mesh}, rank {rank} sent {traffic['sent_messages']} and received "
                f"{traffic['recv_messages']} point-to-point messages; with pp > 1 every stage "
                f"sends activations or gradients to a neighbour stage and receives the other.",
                exercise=EX)


def _judge(outs, want, dp, tp, pp):
    mesh = f"dp={dp} tp={tp} pp={pp}"
    for out in outs:
        rank = out["rank"]
        # tp fastest, then dp, then pp (course_lib.mesh)
        pp_i, dp_i = rank // (dp * tp), rank // tp % dp
        if pp_i != pp - 1:
            continue
        losses = out["losses"]
        if not isinstance(losses, list) or len(losses) != len(want):
            raise checks.CheckFailed(f"{EX}: on {mesh}, rank {rank} (the last stage) returned "
                                     f"{losses!r}; expected a list of {len(want)} losses, one "
                                     f"a step.", exercise=EX)
        for step, (got, per_replica) in enumerate(zip(losses, want)):
            expected = per_replica[dp_i]
            if got is not None and math.isclose(got, expected, rel_tol=1e-5, abs_tol=1e-6):
                continue
            if step == 0:
                why = (f"replica {dp_i} must train on rows {dp_i} x B/dp to "
                       f"({dp_i} + 1) x B/dp of each batch, B = {BATCH}, and the last stage "
                       f"return the loss the pipeline computed on them")
            else:
                why = ("the first step's loss was right, so the update was not the whole "
                       "batch's: average each gradient over its data-parallel group (the "
                       "ranks with the same pp and tp coordinates), after the pipeline's "
                       "last backward")
            raise checks.CheckFailed(
                f"{EX}: on {mesh}, rank {rank} (replica {dp_i}, last stage) reported "
                f"{got!r} at step {step}; one process gives {expected:.6f} on that replica's "
                f"rows.\nHint: {why}.")


@checks.check(EX, hidden=salt.draw)
def check_three_d(train_3d, meshes=tuple(MESHES)):
    for index, (dp, tp, pp) in enumerate(meshes):
        # the work is counted on the first mesh (the counter slows every op down)
        outs = yield on_ranks(three_d_job, train_3d, CFG, dp, tp, pp, STEPS, BATCH,
                              index == 0, nproc=dp * tp * pp, timeout=240)
        _judge(outs, replica_losses(CFG, dp, STEPS, BATCH), dp, tp, pp)
        if index == 0:
            _judge_work(outs, one_process_flops(CFG, STEPS, BATCH), dp, tp, pp)
    return (f"meshes (dp, tp, pp) {list(meshes)}: every replica's loss as one process, "
            f"{STEPS} steps, each rank doing its share")
