"""Training memory from the lecture's formulas (Lab 03): pure arithmetic, no processes.

Notation of the lecture notes: V vocabulary, D model dimension, T sequence
length, N transformer blocks, N_h attention heads, B batch size.

    P = N(12D^2 + 10D) + D(V + T) + 2D + V(D + 1)

Model state per parameter with Adam in mixed precision: bf16 parameters (2),
bf16 gradients (2), fp32 master copy + m + v (12): 16 bytes. The notes' 14P
(= 2P + 3P * 4) counts "just loading weights" and the optimizer: it leaves out
the gradients, which exist from backward to the optimizer step. In fp32 the
total is 16 bytes too (4 + 4 + 8: no master copy needed). ZeRO shards over n
ranks: stage 1 the optimizer state, stage 2 also the gradients, stage 3 (FSDP)
also the parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9  # the notes' (and vendors') gigabyte: 80 GB cards hold 80e9 bytes


@dataclass(frozen=True)
class ModelShape:
    vocab: int  # V
    dim: int  # D
    seq_len: int  # T
    layers: int  # N
    heads: int  # N_h


# The notes' OLMo table, with 1B's D = 2048: the table's 2046 is a typo (OLMo's
# 1B config, quoted on the notes' DDP slide, has d_model 2048). The formula then
# gives P = 0.941B; the slide's 0.944B is reproduced by neither value of D.
OLMO = {
    "OLMo 1B": ModelShape(vocab=32100, dim=2048, seq_len=2048, layers=16, heads=16),
    "OLMo 7B": ModelShape(vocab=32100, dim=4096, seq_len=2048, layers=32, heads=32),
    "OLMo 70B": ModelShape(vocab=50280, dim=8192, seq_len=4096, layers=80, heads=64),
}


def param_count(cfg):
    """P for a ModelShape or the course's GPTConfig (same attribute names)."""
    v, d, t, n = cfg.vocab, cfg.dim, cfg.seq_len, cfg.layers
    return n * (12 * d * d + 10 * d) + d * (v + t) + 2 * d + v * (d + 1)


def piece_params(cfg):
    """(embeddings, one block, head): the terms of P, for a ModelShape or GPTConfig.
    The embeddings D(V+T), a block 12D^2 + 10D, the head 2D + V(D+1) (final
    LayerNorm and output layer); P = embeddings + N * block + head."""
    d, v, t = cfg.dim, cfg.vocab, cfg.seq_len
    return d * (v + t), 12 * d * d + 10 * d, 2 * d + v * (d + 1)


def model_state_bytes(p, n=1, stage=0, mixed=True):
    """{"params", "grads", "optimizer", "total"} bytes per rank for ZeRO ``stage``
    (0 = DDP) on ``n`` ranks, Adam(W); ``mixed``: bf16 weights and gradients with
    an fp32 master copy, else everything fp32."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    params, grads, optimizer = (2 * p, 2 * p, 12 * p) if mixed else (4 * p, 4 * p, 8 * p)
    out = {"params": params / (n if stage >= 3 else 1),
           "grads": grads / (n if stage >= 2 else 1),
           "optimizer": optimizer / (n if stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def activation_bytes(shape, batch, checkpointing=False):
    """The notes' 5NBTD (feed-forward) + B N N_h T^2 (attention scores)
    + 2BVT (embedding/logits) + 2BTD (norms, head), in bytes as the notes count
    them (half-precision activations, the constants of their implementation).

    With activation checkpointing only each block's input is kept (2BTD bytes
    per block in bf16) and one block's activations live at a time while it is
    recomputed in backward: 2NBTD + (5BTD + B N_h T^2) + 2BVT + 2BTD."""
    v, d, t, n, h, b = shape.vocab, shape.dim, shape.seq_len, shape.layers, shape.heads, batch
    if not checkpointing:
        return 5 * n * b * t * d + b * n * h * t * t + 2 * b * v * t + 2 * b * t * d
    return 2 * n * b * t * d + (5 * b * t * d + b * h * t * t) + 2 * b * v * t + 2 * b * t * d


def activation_bytes_megatron(shape, batch, flash=False):
    """Korthikanti et al. (2022)'s count for a Megatron GPT layer, in 16-bit, with no
    recomputation and no parallelism: each of the N layers keeps s b h (34 + 5 a s / h)
    bytes (s = T, b = B, h = D, a = N_h). The 5 a s^2 b of it are the attention scores,
    softmax and dropout mask; a fused attention kernel (FlashAttention, torch's
    scaled_dot_product_attention, which the course's GPT calls) never stores them:
    34 s b h per layer. Embeddings and logits are left out, as in the paper."""
    d, t, n, h, b = shape.dim, shape.seq_len, shape.layers, shape.heads, batch
    per_layer = 34 * t * b * d + (0 if flash else 5 * h * t * t * b)
    return n * per_layer


def other_bytes(shape, batch):
    """Inputs and targets: 2BT."""
    return 2 * batch * shape.seq_len


def fsdp_peak_param_bytes(unit_bytes, n, prefetch=0, root_bytes=0):
    """sum(psi_i)/n + (prefetch + 1) max(psi_i): every shard, plus the units
    gathered at once (the one computing and those prefetched).

    ``root_bytes``: a root unit kept whole from its forward to its backward
    (torch FSDP2's default for the root, and ours: its output layer is the last
    thing forward uses and the first backward needs) adds psi_root, and its
    shard is already in ``unit_bytes``."""
    return sum(unit_bytes) / n + (prefetch + 1) * max(unit_bytes) + root_bytes


def gpus_needed(total_bytes, card_gb):
    return math.ceil(total_bytes / (card_gb * GB))


def memory_table(batch=1, checkpointing=False, shapes=None):
    """Rows (name, P, 14P GB as the notes, 16P GB, activations GB, GPUs of 40 GB
    and of 80 GB to hold the 16P model state fully sharded) for the OLMo shapes."""
    rows = []
    for name, shape in (shapes or OLMO).items():
        p = param_count(shape)
        state = model_state_bytes(p)["total"]
        act = activation_bytes(shape, batch, checkpointing) + other_bytes(shape, batch)
        rows.append((name, p, 14 * p / GB, state / GB, act / GB,
                     gpus_needed(state, 40), gpus_needed(state, 80)))
    return rows
