"""Ring attention: context parallelism from send/recv (Lab 07).

Each of the n ranks of ``group`` holds its chunk of the sequence of q, k and v (the
positions of :func:`~course_lib.cp.blockwise.chunk_positions` for ``layout``). The
key/value blocks travel around the ring: at step t rank r attends with its queries to
the block of rank r - t, merging the partial results by their log-sum-exp
(:func:`~course_lib.cp.blockwise.merge`), while the block sends on to rank r + 1 and
the next one arrives from rank r - 1 (the exchange runs under the compute). After n
steps every query has seen every key: the output equals dense attention on the whole
sequence. Causal attention skips a block no query of the rank may see; with the
contiguous layout rank r then computes r + 1 blocks and rank n - 1 sets the pace, while
zigzag (chunks r and 2n-1-r) gives every rank the same work.

Backward is a ring too: the blocks go round again with the gradients of their keys and
values, each rank adding its queries' share (the softmax's backward needs only the
saved output and log-sum-exp), and after n passes every block is home with its whole
gradient. Shapes are ``scaled_dot_product_attention``'s: (batch, heads, local_seq, d)::

    out = ring_attention(q_chunk, k_chunk, v_chunk, group=cp_group, layout="zigzag")
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import comm, trace
from course_lib.cp.blockwise import attention_with_lse, causal_mask, chunk_positions, merge


def _visible(group, owner, causal, layout, s_local):
    """The causal mask of this rank's queries against ``owner``'s keys (None: all
    visible), and whether any query sees any key."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if not causal:
        return None, True
    mask = causal_mask(chunk_positions(r, n, n * s_local, layout),
                       chunk_positions(owner, n, n * s_local, layout))
    return mask, bool(mask.any())


def _pass_right(tensor, group):
    """Send ``tensor`` to rank r + 1 and receive the same shape from r - 1; (handle, buffer)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    incoming = torch.empty_like(tensor)
    handle = comm.exchange_async(sends=[(tensor, (r + 1) % n)], recvs=[(incoming, (r - 1) % n)],
                                 group=group)
    return handle, incoming


def ring_forward(q, k, v, group, causal, layout):
    """(output, log-sum-exp) of this rank's queries over the whole sequence."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    kv, out, lse = torch.stack([k, v]), None, None
    for t in range(n):
        owner = (r - t) % n
        pending = _pass_right(kv, group) if t < n - 1 else None  # under this block's compute
        mask, any_visible = _visible(group, owner, causal, layout, q.shape[-2])
        if any_visible:
            with trace.span(f"attention block {owner}", "compute"):
                o, l = attention_with_lse(q, kv[0], kv[1], mask)
                out, lse = (o, l) if out is None else merge(out, lse, o, l)
        if pending:
            pending[0].wait()
            kv = pending[1]
    return out, lse


def ring_backward(q, k, v, out, lse, grad_out, group, causal, layout):
    """(dq, dk, dv) of this rank's chunk: dS = P (dP - D) with P = exp(S - lse),
    dP = dO V^T and D = rowsum(dO O), block by block around the ring."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    scale = q.shape[-1] ** -0.5
    delta = (grad_out * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(q)
    kv = torch.stack([k, v])
    dkv = torch.zeros_like(kv)
    for t in range(n):
        owner = (r - t) % n
        mask, any_visible = _visible(group, owner, causal, layout, q.shape[-2])
        if any_visible:
            with trace.span(f"attention backward block {owner}", "compute"):
                scores = (q @ kv[0].transpose(-2, -1)) * scale
                if mask is not None:
                    scores = scores.masked_fill(~mask, float("-inf"))
                p = torch.exp(scores - lse.unsqueeze(-1))
                dkv[1] += p.transpose(-2, -1) @ grad_out
                ds = p * (grad_out @ kv[1].transpose(-2, -1) - delta)
                dq += (ds @ kv[0]) * scale
                dkv[0] += (ds.transpose(-2, -1) @ q) * scale
        if n == 1:
            break
        # the block moves on with its gradient; the last pass brings the gradient home
        handle, incoming = _pass_right(torch.cat([kv, dkv]) if t < n - 1 else dkv, group)
        handle.wait()
        if t < n - 1:
            kv, dkv = incoming[:2], incoming[2:].clone()
        else:
            dkv = incoming
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """Forward and backward both rings (see the module's docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout):
        out, lse = ring_forward(q, k, v, group, causal, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout = group, causal, layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, out, lse, grad_out.contiguous(), ctx.group,
                                   ctx.causal, ctx.layout)
        return dq, dk, dv, None, None, None


def ring_attention(q, k, v, group=None, causal=True, layout="contiguous"):
    """Attention of this rank's chunk of queries over the whole sequence, which the
    ranks of ``group`` hold in chunks as ``layout`` says; differentiable."""
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"q, k and v must have one shape (batch, heads, local_seq, d), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    chunk_positions(0, dist.get_world_size(group), dist.get_world_size(group) * q.shape[-2],
                    layout)  # refuses a layout that cannot cut this sequence
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, causal,
                               layout)
