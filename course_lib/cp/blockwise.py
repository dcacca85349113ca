"""Attention one block of keys at a time, exactly (Lab 07: the arithmetic under ring
attention).

Softmax attention over keys split into blocks K_1, K_2, ... can be computed block by
block if each partial result keeps its log-sum-exp. For queries q (scale 1/sqrt(d)):

    o_j = softmax(q K_j^T) V_j,        l_j = log sum_k exp(q k^T), k in K_j

and two partial results merge into the result over both blocks (the online softmax):

    l = log(e^{l_a} + e^{l_b}),        o = e^{l_a - l} o_a + e^{l_b - l} o_b

A query that sees no key of a block (causal masking) has l_j = -inf and o_j = 0, which
the merge weighs by zero. Shapes are ``scaled_dot_product_attention``'s: q
(batch, heads, s_q, d), k and v (batch, heads, s_k, d); l is (batch, heads, s_q)::

    out_a, lse_a = attention_with_lse(q, k[..., :8, :], v[..., :8, :])
    out_b, lse_b = attention_with_lse(q, k[..., 8:, :], v[..., 8:, :])
    out, lse = merge(out_a, lse_a, out_b, lse_b)   # == attention over all of k
"""
from __future__ import annotations

import torch


def attention_with_lse(q, k, v, mask=None):
    """(output, log-sum-exp) of softmax attention of ``q`` over ``k``, ``v``; ``mask``
    (broadcast to (s_q, s_k)) is True where a query may see a key. Rows that see no
    key give output 0 and log-sum-exp -inf."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - -inf) is nan: a row with no key subtracts 0 instead and weighs 0
    weights = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return weights @ v, lse


def merge(out_a, lse_a, out_b, lse_b):
    """The attention over the keys of both partial results (the online softmax)."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = _finite(lse)
    out = (torch.exp(lse_a - base).unsqueeze(-1) * out_a
           + torch.exp(lse_b - base).unsqueeze(-1) * out_b)
    return out, lse


def _finite(lse):
    return lse.masked_fill(torch.isinf(lse), 0.0)


def chunk_positions(rank, world, seq_len, layout="contiguous"):
    """The sequence positions rank ``rank`` holds of ``seq_len`` on ``world`` ranks:
    ``"contiguous"``: chunk r of n equal chunks; ``"zigzag"``: chunks r and 2n-1-r of
    2n equal chunks, in that order (each rank gets as much causal work)."""
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    parts = world if layout == "contiguous" else 2 * world
    if seq_len % parts:
        raise ValueError(f"a sequence of {seq_len} does not cut into {parts} equal chunks "
                         f"({layout} layout on {world} ranks)")
    size = seq_len // parts
    chunks = [rank] if layout == "contiguous" else [rank, parts - 1 - rank]
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


def causal_mask(q_positions, k_positions):
    """(s_q, s_k) True where the query's position is at or after the key's."""
    return k_positions.unsqueeze(0) <= q_positions.unsqueeze(1)
