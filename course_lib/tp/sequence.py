"""Sequence parallelism (stretch): the replicated parts of a block split along the sequence.

Between the tensor-parallel regions, Megatron's block is replicated: every rank
runs the same LayerNorms, dropout and residual additions on the whole (b, s, h)
activation and keeps it for backward. Sequence parallelism splits those parts
along the sequence instead, s/t tokens per rank, and changes only the operators
at the regions' edges (Korthikanti et al., "Reducing Activation Recomputation"):

====================================  ==========================  ==========================
operator                              forward                     backward
====================================  ==========================  ==========================
``gather_from_sequence`` (replaces f)   all-gather along s          reduce-scatter along s
``reduce_scatter_to_sequence`` (g)      reduce-scatter along s      all-gather along s
``scatter_to_sequence``                 keep this rank's s/t        all-gather along s
====================================  ==========================  ==========================

An all-reduce *is* a reduce-scatter followed by an all-gather, so each rank sends
exactly the bytes it sent before, 2(t-1)/t of b*s*h per operator; what it saves
is the memory and compute of the replicated parts, now 1/t each.

One more thing changes: the LayerNorms' parameters and the row-parallel layers'
biases, still whole on every rank, now see only that rank's tokens, so their
gradients are partial sums. :func:`sync_sequence_parallel_grads` all-reduces
them after backward (one flat all-reduce; Megatron does the same when it
finalises the gradients).

    block = parallelize_block(Block(cfg), tp, sequence_parallel=True)
    x = scatter_to_sequence(x, tp)                      # (b, s/t, h)
    y = gather_from_sequence(block(x), tp, reduce_grads=False)
    loss(y).backward(); sync_sequence_parallel_grads(block, tp)
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from course_lib import trace
from course_lib.tp.operators import check_divides, ops_for, tp_size_and_rank, traced_all_reduce

__all__ = ["scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence",
           "sync_sequence_parallel_grads", "mark_sequence_parallel"]

SEQ = 1  # the sequence dimension of (b, s, h)


def _all_gather_seq(x, group, collectives, label):
    """(b, s/t, h) on each rank -> (b, s, h), rank r's tokens at r*s/t ... ."""
    t, _ = tp_size_and_rank(group)
    local = x.transpose(0, SEQ).contiguous()  # (s/t, b, h): the gathered chunks are contiguous
    full = torch.empty((t * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    with trace.span(label, "comm", bytes=full.numel() * full.element_size()):
        ops_for(collectives).all_gather(full, local, group=group)
    return full.transpose(0, SEQ).contiguous()


def _reduce_scatter_seq(x, group, collectives, label):
    """(b, s, h) partial sums on each rank -> the sum of this rank's (b, s/t, h)."""
    t, _ = tp_size_and_rank(group)
    check_divides(x.shape[SEQ], t, "the sequence length")
    full = x.transpose(0, SEQ).contiguous()
    local = torch.empty((full.shape[0] // t, *full.shape[1:]), dtype=x.dtype, device=x.device)
    with trace.span(label, "comm", bytes=full.numel() * full.element_size()):
        ops_for(collectives).reduce_scatter(local, full, group=group)
    return local.transpose(0, SEQ).contiguous()


def _split_seq(x, group):
    t, r = tp_size_and_rank(group)
    check_divides(x.shape[SEQ], t, "the sequence length")
    return x.chunk(t, dim=SEQ)[r].contiguous()


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, collectives):
        ctx.group, ctx.collectives = group, collectives
        return _split_seq(x, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group, ctx.collectives, "SP: all-gather dX"), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, collectives, reduce_grads):
        ctx.group, ctx.collectives, ctx.reduce_grads = group, collectives, reduce_grads
        return _all_gather_seq(x, group, collectives, "SP: all-gather X")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if ctx.reduce_grads:
            grad = _reduce_scatter_seq(grad, ctx.group, ctx.collectives, "SP: reduce-scatter dX")
        else:
            grad = _split_seq(grad, ctx.group)
        return grad, None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, collectives):
        ctx.group, ctx.collectives = group, collectives
        return _reduce_scatter_seq(x, group, collectives, "SP: reduce-scatter Y")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group, ctx.collectives, "SP: all-gather dY"), None, None


def scatter_to_sequence(x, group=None, collectives="torch"):
    """(b, s, h), the same on every rank -> this rank's (b, s/t, h). Backward:
    all-gather the gradient along s. ValueError unless t divides s."""
    t, _ = tp_size_and_rank(group)
    check_divides(x.shape[SEQ], t, "the sequence length")
    return _ScatterToSequence.apply(x, group, collectives)


def gather_from_sequence(x, group=None, collectives="torch", reduce_grads=True):
    """(b, s/t, h) -> (b, s, h), one all-gather. Backward: reduce-scatter (each
    rank's use of the whole sequence contributed part of its gradient: the role
    of f), or with ``reduce_grads=False`` keep this rank's part (the consumer
    computed the same thing on every rank, e.g. the loss)."""
    tp_size_and_rank(group)
    return _GatherFromSequence.apply(x, group, collectives, reduce_grads)


def reduce_scatter_to_sequence(x, group=None, collectives="torch"):
    """(b, s, h) partial sums -> the sum of this rank's (b, s/t, h): g, split
    along s. Backward: all-gather the gradient along s."""
    return _ReduceScatterToSequence.apply(x, group, collectives)


def mark_sequence_parallel(*params):
    """Flag parameters kept whole whose gradients are partial under sequence parallelism."""
    for p in params:
        p.sequence_parallel = True


@torch.no_grad()
def sync_sequence_parallel_grads(module, group=None, collectives="torch"):
    """Sum, over the group, the gradients of ``module``'s parameters flagged by
    :func:`mark_sequence_parallel` (one flat all-reduce). Call after backward."""
    grads = [p.grad for p in module.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    t, _ = tp_size_and_rank(group)
    if not grads or t == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    traced_all_reduce(flat, group, collectives, "SP: all-reduce replicated grads")
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
