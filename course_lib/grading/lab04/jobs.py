"""Lab 04's jobs: what runs on the student's side, and the data it answers with.

:func:`schedules` and :func:`partitions` call the student's pure functions in the
student's process and hand their answers back as data, each value tagged
(:func:`entry`) so that the check can rebuild what the student returned
(:func:`rebuilt`: an Action, a tuple, a range, or an object of the same type name
and repr) and say what is wrong with it. :func:`stage_job` trains a stage of the
MLP on each rank through the library's executor with the student's forward and
backward, and reports gradients, weights, losses and the stash's peak.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.submission import plain
from course_lib.grading.requests import call_each
from course_lib.pipeline import (Action, PipelineStage, gpipe, mlp_stage, one_f_one_b,
                                 partition, pipeline_step)

MLP_SIZES = [13, 40, 7, 29, 11, 5]
LR, STEPS = 0.1, 2


# ---- on the student's side ----------------------------------------------------------------------
def schedules(schedule_fn, sizes):
    """``schedule_fn(p, m)`` for each size, as data (:func:`entry` keeps Actions, tuples and
    anything else apart, so that the check sees what a schedule held)."""
    answers = call_each(schedule_fn, [((p, m), {}) for p, m in sizes])
    for answer in answers:
        if "value" in answer:
            got = answer["value"]
            answer["value"] = [[entry(a) for a in row] if isinstance(row, (list, tuple))
                               else entry(row) for row in got] \
                if isinstance(got, (list, tuple)) else entry(got)
    return answers


def partitions(partition, cases):
    """``list(partition(costs, p))`` for each case, its ranges as ("R", start, stop, step)."""
    answers = call_each(lambda costs, p: list(partition(costs, p)),
                        [((list(costs), p), {}) for costs, p in cases])
    for answer in answers:
        if "value" in answer:
            answer["value"] = [("R", r.start, r.stop, r.step) if isinstance(r, range)
                               else entry(r) for r in answer["value"]]
    return answers


def entry(a):
    """A value as tagged data: an Action ("A"), a tuple ("T"), other plain data ("P"), or
    its type's name and repr ("S")."""
    tagged = ("A", *a) if isinstance(a, Action) else ("T", *a) if isinstance(a, tuple) \
        else ("P", a)
    try:
        plain.encode(tagged)
    except plain.NotPlain:
        return ("S", type(a).__name__, repr(a)[:200])
    return tagged


def stage_job(forward_step, backward_step, cases):
    """On a rank: STEPS SGD steps of this stage of the MLP through the executor with the
    student's forward and backward; the first step's gradients, the weights, the losses
    and the most microbatches stashed at once."""
    s, p = dist.get_rank(), dist.get_world_size()
    out = []
    for schedule_name, m, rows in cases:
        module = mlp_stage(MLP_SIZES, _stage_layers(p)[s])
        stage = PipelineStage(module, s, p)
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        schedule = (gpipe if schedule_name == "gpipe" else one_f_one_b)(p, m)
        x, y = data(rows)
        first_grads, losses = None, []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = pipeline_step(stage, schedule, batch=x if s == 0 else None,
                                 targets=y if s == p - 1 else None, loss_fn=F.mse_loss,
                                 forward_step=forward_step, backward_step=backward_step)
            if first_grads is None:
                first_grads = {n: q.grad.detach().clone() for n, q in module.named_parameters()
                               if q.grad is not None}
            opt.step()
            losses.append(None if loss is None else float(loss))
        out.append({"grads": first_grads, "losses": losses, "peak": int(stage.peak_in_flight),
                    "state": {k: v.detach().clone() for k, v in module.state_dict().items()}})
    return out


def _stage_layers(p):
    return partition([1] * (2 * len(MLP_SIZES) - 3), p)


def data(rows):
    """The batch and targets of ``rows`` rows (the same on every rank and in the reference)."""
    gen = torch.Generator().manual_seed(4)
    return (torch.randn(rows, MLP_SIZES[0], generator=gen, device="cpu"),
            torch.randn(rows, MLP_SIZES[-1], generator=gen, device="cpu"))


# ---- on the checking side ----------------------------------------------------------------------
def rebuilt(tagged):
    """The value :func:`entry` described (an object of the same type name and repr for "S")."""
    tag, *rest = tagged
    if tag == "A":
        return Action(*rest)
    if tag == "T":
        return tuple(rest)
    if tag == "R":
        return range(*rest)
    if tag == "S":
        return type(rest[0], (), {"__repr__": lambda self, text=rest[1]: text})()
    return rest[0]
