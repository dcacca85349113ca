"""Lab 05's inputs, and the dense values the checks expect (computed in the checking process).

The jobs (:mod:`.jobs`) build the same inputs on the student's ranks from the
same seeds; the checks compare what comes back with what is computed here, on
one process, without tensor parallelism.
"""
from __future__ import annotations

import random

import torch
import torch.nn as nn

from course_lib.tp.volume import grid_volume

LECTURE_X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
LECTURE_A = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
SHAPE = (3, 5, 4)  # f and g's input
H, HIDDEN = 6, 24  # the MLP's widths: the hidden width splits by 2 and 3
SHARDS = {"w1": ("the first layer's weight", 0), "b1": ("the first layer's bias", 0),
          "w2": ("the second layer's weight", 1), "b2": ("the second layer's bias", None)}


def seeded(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), device="cpu")


def group_cases(world):
    """(where, use_pair): the world, and on 3 ranks the pair {0, 1} too."""
    return [("the world", False)] + ([("ranks {0, 1} of 3", True)] if world == 3 else [])


def members(world, use_pair, rank):
    """The global ranks of ``rank``'s group."""
    if not use_pair:
        return list(range(world))
    return [0, 1] if rank < 2 else [2]


# ---- 5.1: the lecture's matrix product and random ones ------------------------------------
def split_cases(seed=5):
    """(X, A, t for the column split, t for the row split)."""
    cases = [(LECTURE_X, LECTURE_A, 2, 3)]  # columns over 2 "GPUs", rows over 3
    rng = random.Random(seed)
    for _ in range(6):
        t_col, t_row = rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
        m, k, n = rng.randint(1, 5), t_row * rng.randint(1, 3), t_col * rng.randint(1, 3)
        cases.append((seeded(rng.randint(0, 999), m, k), seeded(rng.randint(0, 999), k, n),
                      t_col, t_row))
    return cases


# ---- 5.2: f and g -----------------------------------------------------------------------
def f_expected(group):
    """f's output on every rank, and the gradient it gives X (the sum of the upstream ones)."""
    return seeded(1, *SHAPE), sum(seeded(100 + r, *SHAPE) for r in group)


def g_expected(rank, group):
    """g's input on ``rank``, its output (the sum of the inputs), and its input's gradient."""
    return seeded(200 + rank, *SHAPE), sum(seeded(200 + r, *SHAPE) for r in group), \
        seeded(2, *SHAPE)


# ---- 5.3: a parallel MLP --------------------------------------------------------------
def dense_mlp(seed=7):
    """nn.Sequential(Linear(6, 24), GELU, Linear(24, 6)) with random (non-zero) biases."""
    gen = torch.Generator().manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(H, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, H))
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * 0.5)
    return mlp


def mlp_input():
    """The MLP's input X (a leaf that requires grad) and the weights of its loss."""
    return seeded(8, 3, 5, H).requires_grad_(), seeded(9, 3, 5, H)


def one_process(module, x, weight, params):
    """(output, X's gradient, ``params`` ({name: parameter}) and their gradients) of
    the loss sum(module(X) * weight), on one process: what the ranks must reproduce."""
    y = module(x)
    (y * weight).sum().backward()
    return y.detach(), x.grad, {k: v.detach() for k, v in params.items()}, \
        {k: v.grad for k, v in params.items()}


def dense_mlp_reference():
    """(output, X's gradient, the dense parameters, their gradients) on one process."""
    mlp = dense_mlp()
    full = {"w1": mlp[0].weight, "b1": mlp[0].bias, "w2": mlp[2].weight, "b2": mlp[2].bias}
    return one_process(mlp, *mlp_input(), full)


def shard(full, dim, r, t):
    """Slice ``r`` of ``t`` of a dense parameter along ``dim`` (None: all of it)."""
    return full if dim is None else full.chunk(t, dim=dim)[r]


# ---- 5.4: attention split by heads ------------------------------------------------------
QKV_CASES = [(6, 1), (6, 2), (6, 3), (4, 2), (4, 4), (2, 2)]  # (heads, t)


def drawn_qkv_cases(rng):
    """The gradebook's hidden (heads, t): more heads and ranks than the notebook shows."""
    return tuple((t * rng.randint(3, 6), t) for t in (rng.randint(2, 5) for _ in range(2)))


def qkv_weight(heads, t):
    dim = 2 * heads
    return seeded(heads * 10 + t, 3 * dim, dim)


def expected_qkv(weight, rank, t):
    return torch.cat([part.chunk(t, dim=0)[rank] for part in weight.chunk(3, dim=0)])


def seeded_attention():
    """The course's attention layer (dim 12, 6 heads), its weights from seed 11."""
    from course_lib.models import CausalSelfAttention, GPTConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        return CausalSelfAttention(GPTConfig(dim=12, heads=6))


def attention_input():
    return seeded(12, 3, 5, 12).requires_grad_(), seeded(13, 3, 5, 12)


def dense_heads():
    """The dense attention's output and its input's gradient."""
    attn = seeded_attention()
    x, weight = attention_input()
    y = attn(x)
    (y * weight).sum().backward()
    return y.detach(), x.grad


# ---- 5.5: communication volume ----------------------------------------------------------
def volume_cases(trials, seed=9):
    """(m, k, n, gx, gy, gz): Megatron's column and row layers, 2D and 3D grids, random ones."""
    rng = random.Random(seed)
    cases = [(4096, 8192, 8192, 1, 4, 1), (4096, 8192, 8192, 4, 1, 1),  # Megatron column, row
             (4096, 8192, 8192, 2, 2, 1), (4096, 8192, 8192, 2, 2, 2), (10, 6, 12, 1, 1, 1)]
    return cases + [(rng.randint(1, 512), rng.randint(1, 256), rng.randint(1, 256),
                     rng.randint(1, 8), rng.randint(1, 8), rng.randint(1, 8))
                    for _ in range(trials)]


def expected_volume(m, k, n, gx, gy, gz):
    return grid_volume(m, k, n, gx, gy, gz)["total"]
