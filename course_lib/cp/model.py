"""The course GPT with context parallelism: every rank of the cp group holds its chunk
of each sequence (Lab 07).

:class:`ContextParallelAttention` is the GPT's attention with ring attention in place
of dense attention: q, k and v are projected from the rank's chunk (the projections
are per token, so need no neighbour), the ring brings every earlier key, and the
output projection is per token again. Everything else in a block is per token too, so
:func:`context_parallel` swaps only the attention. The positions of a rank's tokens
are those of its layout (:func:`~course_lib.cp.blockwise.chunk_positions`), so the
position embedding is looked up at them (:func:`cp_logits`).

Every rank holds every weight. A rank's loss is the sum of its tokens' cross-entropies
over all the tokens of the batch, so the ranks' losses add up to the mean, and the
summed gradients (an all-reduce over cp) are the whole batch's::

    model = context_parallel(GPT(cfg), group=cp_group, layout="zigzag")
    loss_share = cp_loss(model, tokens, targets, group=cp_group, layout="zigzag")
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.cp.blockwise import chunk_positions
from course_lib.cp.ring_attention import ring_attention
from course_lib.models import CausalSelfAttention


class ContextParallelAttention(nn.Module):
    """The GPT's causal self-attention on this rank's chunk of the sequence."""

    @classmethod
    def from_dense(cls, attn: CausalSelfAttention, group=None, layout="contiguous"):
        layer = cls()
        layer.heads, layer.group, layer.layout = attn.heads, group, layout
        layer.qkv, layer.proj = copy.deepcopy(attn.qkv), copy.deepcopy(attn.proj)
        return layer

    def forward(self, x):  # (B, T_local, D)
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        y = ring_attention(q, k, v, group=self.group, causal=True, layout=self.layout)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def context_parallel(model, group=None, layout="contiguous"):
    """``model`` (the course GPT) with every block's attention context parallel."""
    for block in model.blocks:
        block.attn = ContextParallelAttention.from_dense(block.attn, group, layout)
    return model


def cp_logits(model, tokens, group=None, layout="contiguous"):
    """Logits of this rank's chunk of ``tokens`` (the whole (B, T) batch, the same on
    every rank) and the chunk's positions."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    positions = chunk_positions(r, n, tokens.shape[1], layout).to(tokens.device)
    x = model.tok(tokens[:, positions]) + model.pos(positions)
    for block in model.blocks:
        x = block(x)
    return model.head(model.ln_f(x)), positions


def cp_loss(model, tokens, targets, group=None, layout="contiguous"):
    """This rank's share of the batch's mean cross-entropy: its tokens' sum over B x T."""
    logits, positions = cp_logits(model, tokens, group, layout)
    picked = targets[:, positions]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), picked.reshape(-1),
                           reduction="sum") / targets.numel()


def sum_gradients(model, group=None):
    """Add up the ranks' gradients (their loss shares add up to the batch's loss)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
