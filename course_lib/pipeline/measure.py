"""Measuring a pipeline: the bubble on a real timeline, and stages of known duration.

:func:`measured_bubble` reads the executor's action spans from a trace: over
the step's window (first action start to last action end, all ranks), the
fraction of stage-time in no action, idle / (p * window), the same definition
:func:`~course_lib.pipeline.simulate.simulate` uses.

:class:`FixedTimeStage` stands in for a stage's GPU kernels: its forward takes
t_f and its backward t_b of wall time while leaving the CPU free (it sleeps,
as a host waits for a GPU). On a 2-core machine four ranks doing real
arithmetic share two cores and distort each other's timings; stages that
sleep do not, so the measured bubble can be held against (p-1)/(m+p-1).
On a GPU rank a receive returns once it is *enqueued*: before sleeping, a stage
waits on the device for its input to have arrived (:func:`~course_lib.sync`),
as the kernels it stands for would; without that the sleeps would overlap the
transfers they should follow, and the bubble would collapse toward 0.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from course_lib.pipeline.schedules import Action
from course_lib.runtime.device import sync
from course_lib.trace.metrics import total


class _Sleep(torch.autograd.Function):
    """y = x * w, taking t_f to compute and t_b to differentiate."""

    @staticmethod
    def forward(ctx, x, weight, t_f, t_b):
        ctx.save_for_backward(x, weight)
        ctx.t_b = t_b
        sync()  # the input has arrived (on a GPU, a received tensor is ready only then)
        time.sleep(t_f)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        sync()  # the gradient from the next stage has arrived
        time.sleep(ctx.t_b)
        return grad * weight, (grad * x).sum().reshape(weight.shape), None, None


class FixedTimeStage(nn.Module):
    """A stage whose forward takes ``t_f`` seconds and backward ``t_b`` (per
    microbatch, whatever its size), computing y = w x with one scalar weight."""

    def __init__(self, t_f=0.01, t_b=0.02):
        super().__init__()
        self.t_f, self.t_b = t_f, t_b
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return _Sleep.apply(x, self.weight, self.t_f, self.t_b)


def action_spans(trace, step=None):
    """The executor's action spans of one step (default: the last traced step)."""
    spans = [sp for sp in trace.select(cat="compute") if sp.args.get("kind") in ("F", "B", "W")]
    if not spans:
        raise ValueError("the trace has no pipeline actions: trace a pipeline_step")
    if step is None:
        step = max(sp.args.get("step", 0) for sp in spans)
    return [sp for sp in spans if sp.args.get("step", 0) == step]


def measured_bubble(trace, step=None):
    """idle / (p * window) of one traced step: p = ranks with actions, window =
    first action start to last action end over all of them."""
    spans = action_spans(trace, step)
    ranks = sorted({sp.rank for sp in spans})
    start, end = min(sp.start for sp in spans), max(sp.end for sp in spans)
    window = end - start
    if window <= 0:
        return 0.0
    busy = sum(total([(sp.start, sp.end) for sp in spans if sp.rank == r]) for r in ranks)
    return 1.0 - busy / (len(ranks) * window)


def measured_timeline(trace, step=None):
    """One traced step as a simulation-like timeline: per stage (rank order),
    [(Action, start, end)] with times from the step's first action."""
    spans = action_spans(trace, step)
    t0 = min(sp.start for sp in spans)
    rows = {}
    for sp in sorted(spans, key=lambda sp: sp.start):
        stage = sp.args.get("stage", sp.rank)
        rows.setdefault(stage, []).append(
            (Action(sp.args["kind"], sp.microbatch), sp.start - t0, sp.end - t0))
    return [rows[k] for k in sorted(rows)]

