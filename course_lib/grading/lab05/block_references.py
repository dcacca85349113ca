"""Exercise 5.6's references: the dense block, the slice of each of its parameters that
rank r of t must hold, and what a rank computes under the usual mistakes.

The student names their parameters as they like, so the check finds each one by its
values: every dense parameter has values of its own (:func:`dense_block`, and
:func:`~course_lib.tp.training.distinct_init` for the GPT), and :func:`match` says
which slice of which dense parameter each of the student's parameters is.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from course_lib.grading.lab05.references import expected_qkv, one_process, seeded

DIM, HEADS = 12, 6  # 6 heads split over 2 and 3 ranks; the MLP's 48 hidden units too
# how rank r of t holds each parameter of a block: None whole, 0 or 1 chunk r along that
# dim of nn.Linear's (out, in) weight, "heads" its heads' rows of each of q, k and v
LAYOUT = {"ln1.weight": None, "ln1.bias": None, "ln2.weight": None, "ln2.bias": None,
          "attn.qkv.weight": "heads", "attn.proj.weight": 1, "attn.proj.bias": None,
          "mlp.0.weight": 0, "mlp.0.bias": 0, "mlp.2.weight": 1, "mlp.2.bias": None}
HOW = {None: "all of it, on every rank",
       0: "chunk r of t of its rows (a column split: nn.Linear stores the weight as (out, in))",
       1: "chunk r of t of its columns (a row split)",
       "heads": "its heads' rows of each of q, k and v, stacked (what your shard_qkv returns)"}
_IN_BLOCK = re.compile(r"^blocks\.\d+\.")


def layout(name):
    """How a rank holds dense parameter ``name`` (of a block, or of the GPT: the
    embeddings, the final LayerNorm and the head are whole)."""
    return LAYOUT.get(_IN_BLOCK.sub("", name))


def expected_shard(name, full, r, t):
    how = layout(name)
    if how is None:
        return full
    if how == "heads":
        return expected_qkv(full, r, t)
    return full.chunk(t, dim=how)[r]


# ---- the dense block and its input -----------------------------------------------------
def dense_block(heads=HEADS):
    """The course GPT's ``Block`` (width 12), every parameter drawn from seed 17."""
    from course_lib.models import Block, GPTConfig

    with torch.random.fork_rng(devices=[]):  # Block's own init must not move the rank's RNG
        block = Block(GPTConfig(dim=DIM, heads=heads))
    gen = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for name, p in block.named_parameters():
            centre = 1.0 if name.startswith("ln") and name.endswith("weight") else 0.0
            p.copy_(centre + 0.3 * torch.randn(p.shape, generator=gen, device="cpu"))
    return block


def block_input():
    """The block's input X (a leaf that requires grad) and the weights of its loss."""
    return seeded(21, 3, 5, DIM).requires_grad_(), seeded(22, 3, 5, DIM)


def dense_block_reference():
    """(output, X's gradient, the dense parameters, their gradients) on one process."""
    block = dense_block()
    return one_process(block, *block_input(), dict(block.named_parameters()))


# ---- which slice is which ----------------------------------------------------------------
def _shards(full, r, t):
    """{(dense name, part): what rank r holds}; part None is the whole slice, and the fused
    q/k/v slice may also be held as its three parts "q", "k", "v"."""
    out = {}
    for name, tensor in full.items():
        want = expected_shard(name, tensor, r, t)
        out[name, None] = want
        if layout(name) == "heads":
            out.update({(name, part): piece for part, piece in zip("qkv", want.chunk(3))})
    return out


def _same(a, b):
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)


def match(params, full, r, t):
    """{student name: (dense name, part)} for the student's parameters that are rank r's
    slices; (that mapping, [student names that are none], [dense names left uncovered],
    [(student name, student name) holding the same slice])."""
    shards, found, strays, doubles = _shards(full, r, t), {}, [], []
    for name, value in params.items():
        key = next((k for k, want in shards.items() if _same(value, want)), None)
        if key is None:
            strays.append(name)
            continue
        twin = next((other for other, k in found.items() if k == key), None)
        if twin is not None:
            doubles.append((twin, name))
        found[name] = key
    held = {}
    for dense, part in found.values():
        held.setdefault(dense, set()).add(part)
    uncovered = [n for n in full if None not in held.get(n, ()) and
                 not (layout(n) == "heads" and set("qkv") <= held.get(n, set()))]
    return found, strays, uncovered, doubles


def identify(value, full, r, t):
    """What a parameter that is not rank r's slice is, if anything: ("whole", dense name),
    ("slice", dense name, dim, chunk i), ("transposed", dense name) or None."""
    for name, tensor in full.items():
        if _same(value, tensor):
            return ("whole", name)
        if isinstance(value, torch.Tensor) and value.dim() == 2 and \
                _same(value.t(), expected_shard(name, tensor, r, t)):
            return ("transposed", name)
        for dim in range(tensor.dim()):
            for i, piece in enumerate(tensor.chunk(t, dim=dim)):
                if _same(value, piece):
                    return ("slice", name, dim, i)
    return None


# ---- what rank r computes, right and under a mistake ------------------------------------------
def _attention_partial(block, z, i, t):
    """Rank i's heads of the attention, through its columns of the output projection."""
    attn, (b, s, h) = block.attn, z.shape
    q, k, v = F.linear(z, expected_qkv(attn.qkv.weight, i, t)).chunk(3, dim=-1)
    q, k, v = (u.view(b, s, attn.heads // t, h // attn.heads).transpose(1, 2) for u in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
    return F.linear(y, attn.proj.weight.chunk(t, dim=1)[i])


def _mlp_partial(block, z, i, t):
    fc1, fc2 = block.mlp[0], block.mlp[2]
    hidden = F.gelu(F.linear(z, fc1.weight.chunk(t, dim=0)[i], fc1.bias.chunk(t, dim=0)[i]))
    return F.linear(hidden, fc2.weight.chunk(t, dim=1)[i])


MISTAKES = ("no g", "bias before g", "residual before g")


@torch.no_grad()
def rank_output(block, x, r, t, mistake=None, where=None):
    """The block's output on rank r of t, or what it is when the ``where`` branch
    ("attention" or "MLP") makes ``mistake`` (one of :data:`MISTAKES`). Every rank is
    followed: after a mistake the ranks' activations differ, and the next g sums
    partial results computed from different inputs."""
    def branch(label, partial, bias, norm, xs):
        parts = [partial(block, norm(x_i), i, t) for i, x_i in enumerate(xs)]
        if label != where or mistake is None:
            return [x_i + sum(parts) + bias for x_i in xs]
        if mistake == "no g":
            return [x_i + part + bias for x_i, part in zip(xs, parts)]
        if mistake == "bias before g":
            return [x_i + sum(parts) + t * bias for x_i in xs]
        return [sum(xs) + sum(parts) + bias] * t  # "residual before g": g(x_i + part_i)

    hs = branch("attention", _attention_partial, block.attn.proj.bias, block.ln1, [x] * t)
    return branch("MLP", _mlp_partial, block.mlp[2].bias, block.ln2, hs)[r]
