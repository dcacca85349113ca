"""Compute regions on the timeline: the local work between f and g, forward and backward.

A tensor-parallel layer alternates communication (f, g: their own ``comm``
spans) and local compute. :func:`compute_region` wraps the local part so a
traced run shows it as ``compute`` spans, one in forward and one in backward,
that do not overlap the all-reduces around them::

    x = copy_to_tp(x, group)                          # f  (backward: all-reduce dX)
    y = compute_region("mlp", local_mlp, x)           # compute spans "mlp" / "mlp backward"
    y = reduce_from_tp(y, group)                      # g  (forward: all-reduce Y)

The backward span is bracketed by two identity autograd nodes: the one on the
region's output runs first in backward (it notes the start), the one on its
input runs last (it records the span). They are in the graph whether or not a
trace is recording, so a traced run executes exactly what an untraced one does;
without a tracer they only pass gradients through.
"""
from __future__ import annotations

import torch

from course_lib import trace


class _BackwardEnds(torch.autograd.Function):
    """On the region's input: its backward runs after the region's, closing the span."""

    @staticmethod
    def forward(ctx, x, name, state, meta=None):
        ctx.name, ctx.state, ctx.meta = name, state, meta or {}
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        tracer, start = trace.get_tracer(), ctx.state.pop("start", None)
        if tracer is not None and start is not None:
            tracer.record(f"{ctx.name} backward", "compute", start, tracer.stamp(), **ctx.meta)
        return grad, None, None, None


class _BackwardStarts(torch.autograd.Function):
    """On the region's output: its backward runs before the region's, opening the span."""

    @staticmethod
    def forward(ctx, y, state):
        ctx.state = state
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        tracer = trace.get_tracer()
        if tracer is not None:
            ctx.state["start"] = tracer.stamp()
        return grad, None


def compute_region(name, fn, x, **meta):
    """``fn(x)``, recorded as a ``compute`` span ``name`` in forward and ``name
    backward`` in backward when a trace is recording (both carrying ``meta``). ``x``
    and ``fn(x)`` are tensors; the backward span needs ``x`` to require grad (it ends
    when x's gradient is ready)."""
    state = {}
    x = _BackwardEnds.apply(x, name, state, meta)
    with trace.span(name, "compute", **meta):
        y = fn(x)
    return _BackwardStarts.apply(y, state)
