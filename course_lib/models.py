"""The models every lab trains: a small decoder-only GPT and deep MLPs.

The GPT's parameter count is exactly the lecture's formula

    P = N(12 D^2 + 10 D) + D(V + T) + 2D + V(D + 1)

because its pieces are chosen to match it: per block, the attention's fused
q/k/v projection has no bias (3D^2), its output projection has one (D^2 + D), the
MLP D -> 4D -> D has biases (8D^2 + 5D) and two LayerNorms have weight and bias
(4D); then token and learned position embeddings (D(V + T)), a final LayerNorm
(2D) and an untied output layer with bias (V(D + 1)).

    model = GPT(GPTConfig(vocab=64, dim=32, layers=2, heads=4, seq_len=16), seed=0)
    logits = model(tokens)            # (B, T) int64 -> (B, T, V)

Weights depend only on (seed, parameter name): :func:`init_deterministic` draws
each parameter from a generator seeded by its fully qualified name, so a
pipeline stage or a tensor-parallel shard built alone can reproduce the full
model's values (:func:`param_by_name` gives one parameter's full tensor).
"""
from __future__ import annotations

import hashlib
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


class UseOrderMLP(nn.Module):
    """Linear layers registered as ``layers.0 .. layers.{n-1}`` but applied in
    ``use_order``: the registration order, which DDP buckets by at first, is not
    the order in which backward makes the gradients ready (Lab 02).

        UseOrderMLP(48, use_order=(0, 1, 3, 2))   # backward readies layer 2 first
    """

    def __init__(self, width=48, use_order=(0, 1, 3, 2), seed=0):
        super().__init__()
        if sorted(use_order) != list(range(len(use_order))):
            raise ValueError(f"use_order must be a permutation of 0..n-1, got {use_order}")
        self.use_order = tuple(use_order)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in use_order)
        init_deterministic(self, seed)

    def forward(self, x):
        for i in self.use_order:
            x = torch.tanh(self.layers[i](x))
        return x


def param_seed(name: str, seed: int) -> int:
    """The generator seed of parameter `name` (its fully qualified name in the
    full model, e.g. "blocks.2.mlp.0.weight") under model seed `seed`.

    A stable digest of both, not Python's hash(), which is salted per process:
    every rank, process and machine gets the same number."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: any Generator takes it


def param_by_name(name: str, shape, seed: int) -> torch.Tensor:
    """The full float32 CPU tensor that parameter `name` of `shape` gets under
    `seed`: zeros for biases, ones for other 1-D parameters (norm weights),
    N(0, 0.02) for 2-D weights (0.01 for position embeddings, and for other
    shapes) scaled down by sqrt(256 / fan_in) when fan_in > 256.

    Only the name, shape and seed decide it, so a tensor-parallel rank can take
    its slice of the full tensor without building the full model:

        w = param_by_name("blocks.0.mlp.0.weight", (4 * D, D), seed)   # (4D, D)
        shard = w.chunk(tp, dim=0)[tp_rank]                            # column parallel
    """
    # device="cpu" everywhere: under NCCL the rank's default device is its GPU,
    # and the generator (hence the values) must not depend on that.
    shape = torch.Size(shape)
    if name.endswith("bias"):
        return torch.zeros(shape, device="cpu")
    if len(shape) == 1:
        return torch.ones(shape, device="cpu")
    gen = torch.Generator(device="cpu").manual_seed(param_seed(name, seed))
    std = 0.02 if len(shape) == 2 and "pos" not in name else 0.01
    # scaled in place: one tensor of the parameter's size, not two (Lab 08's meta init
    # peaks at one shard plus the largest parameter)
    value = torch.randn(shape, generator=gen, device="cpu").mul_(std)
    if len(shape) == 2 and shape[1] > 0:
        value *= min(1.0, math.sqrt(256 / shape[1]))
    return value


@torch.no_grad()
def init_deterministic(module: nn.Module, seed: int, prefix: str = "") -> nn.Module:
    """Give every parameter of `module` its :func:`param_by_name` value, on any
    device and dtype, in any process.

    `prefix` is the module's own fully qualified name inside the full model, so
    a part built alone gets the full model's weights: a pipeline stage holding
    the GPT's blocks 2 and 3 initialises them as

        for i, block in enumerate(stage.blocks, start=2):
            init_deterministic(block, seed, prefix=f"blocks.{i}.")

    Each parameter is drawn from its own generator (seeded by name), so the
    order and the set of parameters a module holds do not change the values.
    Parameters on the meta device are skipped: they have no values to give
    (:mod:`course_lib.checkpoint.meta_init` gives each rank its slice later)."""
    if prefix and not prefix.endswith("."):
        prefix += "."
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            continue
        p.copy_(param_by_name(prefix + name, p.shape, seed).to(p.device, p.dtype))
    return module
