"""The models every lab trains: a small decoder-only GPT and a deep MLP.

The GPT's parameter count is exactly the lecture's formula

    P = N(12 D^2 + 10 D) + D(V + T) + 2D + V(D + 1)

because its pieces are chosen to match it: per block, the attention's fused
q/k/v projection has no bias (3D^2), its output projection has one (D^2 + D), the
MLP D -> 4D -> D has biases (8D^2 + 5D) and two LayerNorms have weight and bias
(4D); then token and learned position embeddings (D(V + T)), a final LayerNorm
(2D) and an untied output layer with bias (V(D + 1)).

    model = GPT(GPTConfig(vocab=64, dim=32, layers=2, heads=4, seq_len=16), seed=0)
    logits = model(tokens)            # (B, T) int64 -> (B, T, V)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128  # V
    dim: int = 64  # D
    layers: int = 2  # N
    heads: int = 4  # N_h
    seq_len: int = 32  # T

    def __post_init__(self):
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} must be divisible by heads={self.heads}")


def gpt_param_count(cfg: GPTConfig) -> int:
    """P = N(12D^2 + 10D) + D(V+T) + 2D + V(D+1)."""
    n, d, v, t = cfg.layers, cfg.dim, cfg.vocab, cfg.seq_len
    return n * (12 * d * d + 10 * d) + d * (v + t) + 2 * d + v * (d + 1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):  # (B, T, D)
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D/H)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(),
                                 nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)
        init_deterministic(self, seed)

    def forward(self, tokens):  # (B, T) -> logits (B, T, V)
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens, targets):
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def deep_mlp(width=256, depth=4, inputs=32, outputs=10, seed=0):
    """Linear -> ReLU stacks: many parameters, little compute per parameter, the
    easiest model to see communication on."""
    layers, size = [], inputs
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    model = nn.Sequential(*layers, nn.Linear(size, outputs))
    init_deterministic(model, seed)
    return model


@torch.no_grad()
def init_deterministic(model: nn.Module, seed: int):
    """The same weights on any device and process for the same seed (a CPU
    generator, then moved): N(0, 0.02) for weights, zeros for biases, ones for norms."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            value = torch.zeros(p.shape, device="cpu")
        elif p.dim() == 1:  # LayerNorm weight
            value = torch.ones(p.shape, device="cpu")
        else:
            std = 0.02 if p.dim() == 2 and "pos" not in name else 0.01
            value = torch.randn(p.shape, generator=gen, device="cpu") * std
            if p.dim() == 2 and p.shape[1] > 0:
                value *= min(1.0, math.sqrt(256 / p.shape[1]))
        p.copy_(value.to(p.device, p.dtype))
