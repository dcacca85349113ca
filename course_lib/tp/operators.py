"""Megatron's conjugate operators f and g, and split / gather along the last dimension.

Tensor parallelism over t ranks cuts a weight A so that each rank multiplies by
its own block. What moves between the ranks is decided by four operators, each
an autograd Function whose backward is the *conjugate* of its forward:

=================  ===============================  ===============================
operator           forward                          backward
=================  ===============================  ===============================
f  copy_to_tp      Y = X (identity)                 dL/dX = sum_i dL/dY_i (all-reduce)
g  reduce_from_tp  Y = sum_i Y_i (all-reduce)       dL/dY_i = dL/dY (identity)
split_to_tp        X = [X_1 ... X_t] -> X_r         all-gather [dX_1 ... dX_t]
gather_from_tp     X_r -> [X_1 ... X_t]             split: keep dX_r
=================  ===============================  ===============================

f sits where a replicated activation enters a column-parallel layer: every
rank uses the whole X, so X's gradient is the sum of every rank's
contribution. g sits where a row-parallel layer leaves: each rank holds a
partial sum Y_i = X_i A_i, and Y = sum_i Y_i. A column-parallel layer followed
by a row-parallel one (the MLP, the attention) therefore costs one all-reduce
forward (g) and one backward (f)::

    x = copy_to_tp(x, group=tp)                 # f: (b, s, h), replicated
    y = reduce_from_tp(local(x), group=tp)      # g: (b, s, h) partial sums -> the sum

Every collective goes through :func:`course_lib.collectives.collective_ops`
(``collectives="torch"`` or ``"ring"``), so ``comm.counting()`` counts it, and
leaves a ``comm`` span with its bytes on the timeline when a trace is being
recorded. With t = 1 every operator is the identity and sends nothing.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from course_lib import trace
from course_lib.collectives.select import collective_ops

__all__ = ["copy_to_tp", "reduce_from_tp", "split_to_tp", "gather_from_tp", "CopyToTP",
           "ReduceFromTP", "SplitToTP", "GatherFromTP", "tp_size_and_rank", "check_divides",
           "traced_all_reduce", "ops_for"]


@lru_cache(maxsize=None)
def ops_for(kind):
    """The counted collectives of ``kind`` ("torch" or "ring"), made once."""
    return collective_ops(kind)


def tp_size_and_rank(group=None):
    """(t, r): the size of tensor-parallel ``group`` (None: the world) and this
    rank's place in it. Raises ValueError when this rank is not a member."""
    if not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs an initialised process group "
                           "(run it on the ranks, e.g. inside course_lib.run)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of this "
                         f"tensor-parallel group")
    return dist.get_world_size(group), rank


def check_divides(size, t, what):
    """ValueError naming ``what``, its size and t unless t divides size."""
    if size % t:
        raise ValueError(f"{what} = {size} does not divide by the tensor-parallel size "
                         f"t = {t}: every rank needs an equal slice")


def traced_all_reduce(tensor, group, collectives, label, op=dist.ReduceOp.SUM):
    """Reduce ``tensor`` in place over ``group`` (SUM by default), counted by
    ``comm.counting()`` and recorded as a ``comm`` span named ``label``."""
    nbytes = tensor.numel() * tensor.element_size()
    with trace.span(label, "comm", bytes=nbytes):
        ops_for(collectives).all_reduce(tensor, op=op, group=group)
    return tensor


def _gather_last(x, group, collectives, label):
    """[X_1 ... X_t] along the last dimension from each rank's X_r (equal shapes)."""
    t, _ = tp_size_and_rank(group)
    x = x.contiguous()
    flat = torch.empty(t * x.numel(), dtype=x.dtype, device=x.device)
    with trace.span(label, "comm", bytes=flat.numel() * flat.element_size()):
        ops_for(collectives).all_gather(flat, x.view(-1), group=group)
    # t blocks one after another: (t, ..., n) -> (..., t, n) -> (..., t*n), so rank
    # i's block lands at [i*n, (i+1)*n) of the last dimension
    stacked = flat.view(t, *x.shape)
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], t * x.shape[-1])


def _split_last(x, group):
    """X_r of X = [X_1 ... X_t] along the last dimension (a copy, not a view)."""
    t, r = tp_size_and_rank(group)
    check_divides(x.shape[-1], t, "the last dimension")
    return x.chunk(t, dim=-1)[r].contiguous()


class CopyToTP(torch.autograd.Function):
    """f: Y = X forward; dL/dX = sum over the group of dL/dY backward (all-reduce)."""

    @staticmethod
    def forward(ctx, x, group, collectives):
        ctx.group, ctx.collectives = group, collectives
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if dist.get_world_size(ctx.group) == 1:
            return grad, None, None
        # a private contiguous copy: autograd may hand the same buffer to others
        grad = grad.clone(memory_format=torch.contiguous_format)
        return traced_all_reduce(grad, ctx.group, ctx.collectives, "f: all-reduce dX"), None, None


class ReduceFromTP(torch.autograd.Function):
    """g: Y = sum over the group of Y_i forward (all-reduce); dL/dY_i = dL/dY backward."""

    @staticmethod
    def forward(ctx, x, group, collectives):
        if dist.get_world_size(group) == 1:
            return x.view_as(x)
        out = x.clone(memory_format=torch.contiguous_format)
        return traced_all_reduce(out, group, collectives, "g: all-reduce Y")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class SplitToTP(torch.autograd.Function):
    """X = [X_1 ... X_t] -> X_r along the last dimension; backward all-gathers dX."""

    @staticmethod
    def forward(ctx, x, group, collectives):
        ctx.group, ctx.collectives = group, collectives
        if dist.get_world_size(group) == 1:
            return x.view_as(x)
        return _split_last(x, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if dist.get_world_size(ctx.group) == 1:
            return grad, None, None
        return _gather_last(grad, ctx.group, ctx.collectives, "split: all-gather dX"), None, None


class GatherFromTP(torch.autograd.Function):
    """X_r -> [X_1 ... X_t] along the last dimension (all-gather); backward keeps dX_r."""

    @staticmethod
    def forward(ctx, x, group, collectives):
        ctx.group = group
        if dist.get_world_size(group) == 1:
            return x.view_as(x)
        return _gather_last(x, group, collectives, "gather: all-gather Y")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if dist.get_world_size(ctx.group) == 1:
            return grad, None, None
        return _split_last(grad, ctx.group), None, None


def copy_to_tp(x, group=None, collectives="torch"):
    """f. Forward: Y = X, shape unchanged (X replicated on every rank of ``group``).
    Backward: dL/dX = sum_i dL/dY_i, one all-reduce of X's shape."""
    tp_size_and_rank(group)
    ops_for(collectives)  # an unknown kind fails here, not later inside backward
    return CopyToTP.apply(x, group, collectives)


def reduce_from_tp(x, group=None, collectives="torch"):
    """g, f's conjugate. Forward: Y = sum_i X_i, one all-reduce of X's shape (each
    rank holds a partial sum X_i). Backward: dL/dX_i = dL/dY, the identity."""
    tp_size_and_rank(group)
    ops_for(collectives)  # an unknown kind fails here, not later inside backward
    return ReduceFromTP.apply(x, group, collectives)


def split_to_tp(x, group=None, collectives="torch"):
    """X (..., n) -> X_r (..., n/t), rank r's block of X = [X_1 ... X_t]. Backward:
    all-gather the blocks' gradients back to (..., n). ValueError unless t divides n."""
    t, _ = tp_size_and_rank(group)
    check_divides(x.shape[-1], t, "the last dimension")
    ops_for(collectives)
    return SplitToTP.apply(x, group, collectives)


def gather_from_tp(x, group=None, collectives="torch"):
    """X_r (..., n) on every rank -> [X_1 ... X_t] (..., t*n), one all-gather.
    Backward: keep rank r's block of the gradient."""
    tp_size_and_rank(group)
    ops_for(collectives)  # an unknown kind fails here, not later inside backward
    return GatherFromTP.apply(x, group, collectives)
