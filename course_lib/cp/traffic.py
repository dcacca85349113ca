"""Bytes one rank sends in the forward pass of one layer, for the three ways Lab 07
compares of spreading a batch's tokens over n ranks (Prediction 7.2).

A batch of b sequences of s tokens of width h, fp32 (4 bytes an element), n ranks:

- **cp** (ring attention, contiguous or zigzag): a rank's k and v blocks, b (s/n) h
  elements each, travel around the ring; every rank forwards one k/v pair at each of
  the n - 1 steps:                                   2 (n-1) b s h / n elements;
- **tp_sp** (tensor parallelism with sequence parallelism, the attention layer):
  all-gather the sequence before the column-parallel q/k/v, reduce-scatter after the
  row-parallel output projection, each (n-1)/n of b s h on a ring: 2 (n-1) b s h / n;
- **ep** (an MoE layer, each rank feeding b s / n tokens, top-k experts, routing
  even over the ranks and no token dropped): a token's k copies leave for their
  experts' ranks, (n-1)/n of them to another rank, and come back combined:
                                                     2 k (n-1)/n * (b s / n) h.

(The counts EP exchanges first, k E/n int64 per peer, one per expert and choice, and
the other metadata are not in these numbers.) CP and TP+SP send the same bytes for multi-head attention; CP's go
under the attention's compute, TP+SP's are on the critical path; EP's are the tokens
themselves, k times, and an uneven router moves more to the busiest rank.
"""
from __future__ import annotations

SPLITS = ("cp", "tp_sp", "ep")


def layer_bytes_sent(split, b, s, h, n, top_k=1, element_size=4):
    """Bytes rank r sends in one layer's forward pass under ``split`` (see the module)."""
    if split == "cp":
        elements = 2 * (n - 1) * b * s * h / n
    elif split == "tp_sp":
        elements = 2 * (n - 1) / n * b * s * h
    elif split == "ep":
        elements = 2 * top_k * (n - 1) / n * (b * s / n) * h
    else:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return elements * element_size


def measured_bytes_sent(split, b, s, h, heads=4, top_k=1, n_experts=None, seed=0):
    """On every rank of a job: the bytes this rank sends (the course's counted messages)
    in one forward pass of one layer under ``split``, on the setting of
    :func:`layer_bytes_sent` (fp32; for ``ep`` a router that spreads the tokens evenly:
    token i picks experts i, i+1, ..., i+k-1 mod E). Returns (bytes, what else was sent:
    EP's counts)."""
    import torch
    import torch.distributed as dist

    from course_lib import comm
    from course_lib.models import CausalSelfAttention, GPTConfig

    n, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attn = CausalSelfAttention(GPTConfig(vocab=2, dim=h, layers=1, heads=heads, seq_len=s))
    x = torch.randn(b, s, h, generator=gen, device="cpu")
    if split == "cp":
        from course_lib.cp.model import ContextParallelAttention

        layer, local = ContextParallelAttention.from_dense(attn), x.chunk(n, dim=1)[r]
    elif split == "tp_sp":
        from course_lib.tp.blocks import ParallelAttention

        layer = ParallelAttention.from_dense(attn, collectives="ring", sequence_parallel=True)
        local = x.chunk(n, dim=1)[r]
    elif split == "ep":
        layer, local = _even_moe(b * s // n, h, n_experts or 2 * n, top_k, n, r, seed)
    else:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    with torch.no_grad(), comm.counting() as stats:
        layer(local)
    counts = (n - 1) * top_k * ((n_experts or 2 * n) // n) * 8 if split == "ep" and n > 1 else 0
    return stats.sent_bytes - counts, counts


def _even_moe(tokens, h, n_experts, top_k, n, r, seed):
    """An expert-parallel MoE whose router sends token i to experts i .. i+k-1 (mod E),
    and this rank's tokens: every expert, hence every rank, gets the same rows."""
    import torch

    from course_lib.ep.expert_parallel import ExpertParallelMoE
    from course_lib.ep.moe import MoE

    if h < n_experts:
        raise ValueError(f"the even router needs h >= n_experts, got {h} < {n_experts}")
    moe = MoE(h, 2 * h, n_experts, top_k=top_k, capacity_factor=float(top_k * n_experts),
              seed=seed)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:, :n_experts] = torch.eye(n_experts)
    first = r * tokens
    x = torch.zeros(tokens, h)
    for i in range(tokens):
        for j in range(top_k):  # a falling score: choice j is expert i + j
            x[i, (first + i + j) % n_experts] = 10.0 - j
    return ExpertParallelMoE.from_dense(moe), x
