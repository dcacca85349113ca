"""Ulysses context parallelism: all-to-all instead of a ring (Lab 07).

DeepSpeed-Ulysses splits the same thing ring attention splits, the sequence, but moves it
differently. Each of the n ranks of ``group`` holds a contiguous shard of the sequence
for every head: rank r has positions r·s/n to (r+1)·s/n - 1 of q, k and v, each of shape
(b, H, s/n, d). Attention needs every key of a head, but the heads are independent of
one another, so one all-to-all turns "all heads, my tokens" into "my heads, all tokens":
rank r sends the shard of head group p (heads p·H/n to (p+1)·H/n - 1) to rank p and
receives from every rank its shard of head group r. Rank r then runs ordinary attention
(causal or not, any kernel) on H/n heads over the whole sequence, and a second
all-to-all sends each head group's output back to the ranks that own its tokens::

    (b, H, s/n, d) --all-to-all--> (b, H/n, s, d) --attention--> (b, H/n, s, d)
                   --all-to-all--> (b, H, s/n, d)

Backward is the same two all-to-alls in reverse (the gradient of a permutation of data
among the ranks is the inverse permutation), around attention's own backward.

What each rank sends in one layer's forward pass: q, k and v each keep 1/n of their
b·H·(s/n)·d elements and send the rest, and so does the output: 4 (n-1)/n · b s h / n
elements (h = H·d), n/2 times fewer than the ring's 2 (n-1)/n · b s h, and spread over
all n - 1 peers at once instead of one neighbour per step. The price: the heads must
divide among the ranks (H % n == 0; with grouped-query attention the k/v heads too), so
n is bounded by H, and the all-to-all is on the critical path, where the ring hides its
sends under the block compute. Across nodes an all-to-all crosses the slow links with
most of its bytes; a ring crosses them once per step. Ring and Ulysses combine (Ulysses
inside a node, the ring across nodes); this file is Ulysses alone.

Every all-to-all is the course's own (:func:`course_lib.collectives.all_to_all`, from
the counted send/recv), on ``group`` with group-local ranks::

    out = ulysses_attention(q_shard, k_shard, v_shard, group=cp_group, causal=True)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.collectives.all_to_all import all_to_all


def check_heads(heads, n):
    """Ulysses gives each rank H/n whole heads: refuse what does not divide."""
    if heads % n:
        raise ValueError(f"Ulysses gives each of the {n} ranks whole heads, but {heads} heads "
                         f"do not divide by {n}: use ring attention (any n), or a cp size "
                         f"that divides the heads")


def sequence_to_heads(x, group=None):
    """(b, H, s/n, d), this rank's tokens of every head -> (b, H/n, s, d), every token of
    this rank's heads (rank r gets heads r·H/n to (r+1)·H/n - 1), by one all-to-all."""
    n = dist.get_world_size(group)
    b, heads, s_local, d = x.shape
    check_heads(heads, n)
    # piece p of dim 0 goes to rank p: head group p of this rank's tokens
    pieces = x.reshape(b, n, heads // n, s_local, d).transpose(0, 1).contiguous()
    received = torch.empty_like(pieces)
    all_to_all(received, pieces, group=group)
    # received[p]: rank p's tokens of this rank's heads, in sequence order
    return received.permute(1, 2, 0, 3, 4).reshape(b, heads // n, n * s_local, d)


def heads_to_sequence(x, group=None):
    """The inverse of :func:`sequence_to_heads`: (b, H/n, s, d) -> (b, H, s/n, d)."""
    n = dist.get_world_size(group)
    b, my_heads, seq, d = x.shape
    if seq % n:
        raise ValueError(f"a sequence of {seq} tokens does not split into {n} equal shards")
    s_local = seq // n
    # piece p of dim 0 goes to rank p: its tokens of this rank's heads
    pieces = x.reshape(b, my_heads, n, s_local, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(pieces)
    all_to_all(received, pieces, group=group)
    # received[p]: head group p of this rank's tokens
    return received.transpose(0, 1).reshape(b, n * my_heads, s_local, d)


class _Swap(torch.autograd.Function):
    """One swap forward (``to_heads``: sequence -> heads, else heads -> sequence), the
    opposite one on the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return (sequence_to_heads if to_heads else heads_to_sequence)(x, group)

    @staticmethod
    def backward(ctx, grad):
        back = heads_to_sequence if ctx.to_heads else sequence_to_heads
        return back(grad.contiguous(), ctx.group), None, None


def ulysses_attention(q, k, v, group=None, causal=True):
    """Attention over the whole sequence from contiguous sequence shards (see the module).

    q, k, v: (b, H, s/n, d), rank r of ``group`` holding positions r·s/n to
    (r+1)·s/n - 1; H divisible by n. Returns this rank's (b, H, s/n, d) of the output,
    equal to ``scaled_dot_product_attention`` on the whole sequence, with gradients.
    """
    if not (q.shape == k.shape == v.shape and q.dim() == 4):
        raise ValueError(f"q, k, v must share one (b, H, s/n, d) shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    check_heads(q.shape[1], dist.get_world_size(group))
    q, k, v = (_Swap.apply(t, group, True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return _Swap.apply(out, group, False)


def layer_bytes_sent(b, s, h, n, element_size=4):
    """Bytes one rank sends in one layer's forward pass: 4 (n-1)/n · b s h / n elements
    (q, k, v in, the output back), against the ring's 2 (n-1)/n · b s h."""
    return 4 * (n - 1) * b * s * h * element_size / (n * n)
