"""The course GPT's transformer block, tensor parallel: MLP and attention as column-then-row pairs.

Both halves of a block have the same shape in Megatron's scheme: a column-
parallel layer, local work, a row-parallel layer. So each costs one all-reduce
forward (g, on the row layer's output) and one backward (f, on the gradient of
the column layer's input), each of b*s*h elements:

    MLP        Y = g( GELU(f(X) A_r + a_r) B_r ) + b      A: (h, 4h) by columns, B: (4h, h) by rows
    attention  Y = g( attn(f(X) W_qkv,r) W_proj,r ) + b    split by heads: rank r owns heads
                                                            r*H/t ... (r+1)*H/t

Per block: 2 all-reduces forward, 2 backward; LayerNorms and residuals are
replicated and compute the same values on every rank.

Attention is split by heads because heads are independent: rank r computes
softmax(Q_h K_h^T) V_h for its own heads only, and the output projection, split
by rows, turns its heads' outputs into a partial sum. The fused q/k/v weight is
(3h, h) with q, k and v stacked: rank r takes *its heads' rows of each* of q, k
and v (``ColumnParallelLinear(parts=3)``), not a contiguous third of the fused
weight, which would hand rank 0 all of q and some of k.

A sharding plan is data, as with torch's ``parallelize_module``::

    BLOCK_PLAN = {"attn": "attention", "mlp": "mlp"}
    parallelize(block, BLOCK_PLAN, group=tp)        # what parallelize_block(block, tp) does

Submodule names keep the dense block's names (``attn.qkv.weight``,
``mlp.0.weight``...), so each parameter is the slice of the dense parameter of
the same name. :class:`ParallelBlock` makes the same cut into a new module and
leaves the dense block alone: ``model.blocks[i] = ParallelBlock(model.blocks[i], tp)``.
"""
from __future__ import annotations

import copy

import torch.nn as nn
import torch.nn.functional as F

from course_lib.tp.layers import ColumnParallelLinear, RowParallelLinear
from course_lib.tp.operators import copy_to_tp, tp_size_and_rank
from course_lib.tp.regions import compute_region
from course_lib.tp.sequence import (gather_from_sequence, mark_sequence_parallel,
                                    reduce_scatter_to_sequence)

__all__ = ["ParallelMLP", "ParallelAttention", "ParallelBlock", "parallelize", "parallelize_block",
           "BLOCK_PLAN", "STYLES"]


def _sub(name, child):
    return f"{name}.{child}" if name else child


def _enter(module, x):
    """f, or with sequence parallelism the all-gather along s that takes its place."""
    if module.sequence_parallel:
        return gather_from_sequence(x, module.group, module.collectives)
    return copy_to_tp(x, module.group, module.collectives)


def _leave(module, row, partial):
    """g then the bias, or with sequence parallelism a reduce-scatter along s then the bias."""
    if not module.sequence_parallel:
        return row.reduce(partial)
    y = reduce_scatter_to_sequence(partial, module.group, module.collectives)
    return y if row.bias is None else y + row.bias


class ParallelMLP(nn.Sequential):
    """Column-parallel ``0`` (h -> 4h/t), the activation ``1``, row-parallel ``2``
    (4h/t -> h): the dense ``nn.Sequential(Linear, GELU, Linear)`` with each
    Linear replaced by its slice. One all-reduce forward, one backward."""

    def __init__(self, dim, hidden, *, group=None, activation=None, collectives="torch",
                 sequence_parallel=False, name="", seed=0, device=None, dtype=None,
                 _layers=None):
        if _layers is None:
            factory = dict(group=group, collectives=collectives, seed=seed, device=device,
                           dtype=dtype)
            _layers = (ColumnParallelLinear(dim, hidden, name=_sub(name, "0"), **factory),
                       activation if activation is not None else nn.GELU(),
                       RowParallelLinear(hidden, dim, name=_sub(name, "2"), **factory))
        super().__init__(*_layers)
        self.group, self.collectives, self.sequence_parallel = group, collectives, sequence_parallel

    @classmethod
    def from_dense(cls, mlp, group=None, collectives="torch", sequence_parallel=False):
        """Cut ``nn.Sequential(Linear(h, 4h), activation, Linear(4h, h))``."""
        layers = list(mlp) if isinstance(mlp, nn.Sequential) else []
        if len(layers) != 3 or not (isinstance(layers[0], nn.Linear)
                                    and isinstance(layers[2], nn.Linear)):
            raise TypeError("ParallelMLP.from_dense takes nn.Sequential(Linear, activation, "
                            f"Linear), got {mlp!r}")
        fc1, act, fc2 = layers
        column = ColumnParallelLinear.from_dense(fc1, group=group, collectives=collectives)
        row = RowParallelLinear.from_dense(fc2, group=group, input_is_parallel=True,
                                           collectives=collectives)
        return cls(fc1.in_features, fc1.out_features, group=group, collectives=collectives,
                   sequence_parallel=sequence_parallel, _layers=(column, act, row))

    def forward(self, x):
        column, act, row = self
        x = _enter(self, x)  # f (or the all-gather that replaces it)
        partial = compute_region("mlp", lambda z: row.partial(act(column.local(z))), x)
        return _leave(self, row, partial)  # g, then the bias once


class ParallelAttention(nn.Module):
    """Causal self-attention over this rank's H/t heads: ``qkv`` column-parallel by
    heads (weight (3h/t, h)), ``proj`` row-parallel (weight (h, h/t), bias whole).
    ValueError unless t divides the number of heads. ``attend(q, k, v)`` is the
    attention of the local heads (dense and causal; Lab 06's 4D mesh puts Lab 07's ring
    there, over the heads' chunk of the sequence)."""

    @staticmethod
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def __init__(self, dim, heads, *, group=None, collectives="torch", sequence_parallel=False,
                 name="", seed=0, device=None, dtype=None):
        super().__init__()
        t, _ = tp_size_and_rank(group)
        if heads % t:
            raise ValueError(f"ParallelAttention: heads = {heads} does not divide by the "
                             f"tensor-parallel size t = {t}; each rank must hold whole heads")
        if dim % heads:
            raise ValueError(f"ParallelAttention: dim = {dim} does not divide by heads = {heads}")
        self.heads, self.local_heads, self.head_dim = heads, heads // t, dim // heads
        self.group, self.collectives, self.sequence_parallel = group, collectives, sequence_parallel
        factory = dict(group=group, collectives=collectives, seed=seed, device=device, dtype=dtype)
        self.qkv = ColumnParallelLinear(dim, 3 * dim, bias=False, parts=3,
                                        name=_sub(name, "qkv"), **factory)
        self.proj = RowParallelLinear(dim, dim, name=_sub(name, "proj"), **factory)

    @classmethod
    def from_dense(cls, attn, group=None, collectives="torch", sequence_parallel=False):
        """Cut the course's ``CausalSelfAttention`` (fused ``qkv``, ``proj``) by heads."""
        dim = attn.qkv.in_features
        layer = cls(dim, attn.heads, group=group, collectives=collectives, device="meta",
                    sequence_parallel=sequence_parallel, dtype=attn.qkv.weight.dtype)
        layer.qkv = ColumnParallelLinear.from_dense(attn.qkv, group=group, parts=3,
                                                    collectives=collectives)
        layer.proj = RowParallelLinear.from_dense(attn.proj, group=group, input_is_parallel=True,
                                                  collectives=collectives)
        return layer

    def _local(self, x):
        """This rank's heads, up to its partial sum of the output projection."""
        b, s, _ = x.shape
        q, k, v = self.qkv.local(x).chunk(3, dim=-1)  # each (b, s, h/t)
        q, k, v = (z.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
                   for z in (q, k, v))
        y = self.attend(q, k, v)  # (b, H/t, s, h/H)
        return self.proj.partial(y.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        x = _enter(self, x)  # f
        return _leave(self, self.proj, compute_region("attention", self._local, x))  # g, + bias

    def extra_repr(self):
        return f"heads={self.heads}, local_heads={self.local_heads}, head_dim={self.head_dim}"


class ParallelBlock(nn.Module):
    """A drop-in for the course GPT's ``Block``, cut from a dense one (which is left as it
    was): ``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``, with

        attn = g(attention over heads of rank r (f(LN_1(x)))) + b_proj
        mlp  = g(GELU(f(LN_2(x)) A_r + a_r) B_r) + b

    f sits after each LayerNorm, right before the column-parallel layer, so that f's
    backward all-reduce completes the gradient before it reaches the LayerNorm (whose
    parameters every rank holds whole). Each g returns the whole branch output, and
    only then is the residual added: added to a partial sum, X would be counted t
    times. 2 all-reduces forward, 2 backward; ValueError unless t divides the heads.

        model.blocks[i] = ParallelBlock(model.blocks[i], group=tp)
    """

    def __init__(self, block, group=None, collectives="torch"):
        super().__init__()
        # copies: the LayerNorms stay whole on every rank, and the dense block keeps its own
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = ParallelAttention.from_dense(block.attn, group, collectives)
        self.mlp = ParallelMLP.from_dense(block.mlp, group, collectives)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


STYLES = {
    "colwise": lambda m, **kw: ColumnParallelLinear.from_dense(m, **kw),
    "rowwise": lambda m, **kw: RowParallelLinear.from_dense(m, **kw),
    "mlp": lambda m, **kw: ParallelMLP.from_dense(m, **kw),
    "attention": lambda m, **kw: ParallelAttention.from_dense(m, **kw),
}
BLOCK_PLAN = {"attn": "attention", "mlp": "mlp"}


def parallelize(module, plan, group=None, collectives="torch", sequence_parallel=False):
    """Replace, in place, each submodule named in ``plan`` by its tensor-parallel
    version of the given style (``STYLES``: "colwise", "rowwise", "mlp",
    "attention"); returns ``module``. The dense submodules are dropped.
    ``sequence_parallel`` applies to the "mlp" and "attention" styles."""
    unknown = {style for style in plan.values() if style not in STYLES}
    if unknown:
        raise ValueError(f"unknown styles {sorted(unknown)}; choose from {sorted(STYLES)}")
    if sequence_parallel and set(plan.values()) - {"mlp", "attention"}:
        raise ValueError("sequence_parallel needs whole regions: the 'mlp' and 'attention' "
                         "styles, not a lone 'colwise' or 'rowwise' layer")
    for name in plan:
        module.get_submodule(name)  # every name first: fail before changing anything
    extra = {"sequence_parallel": True} if sequence_parallel else {}
    for name, style in plan.items():
        module.set_submodule(name, STYLES[style](module.get_submodule(name), group=group,
                                                 collectives=collectives, **extra))
    return module


def parallelize_block(block, group=None, plan=None, collectives="torch", sequence_parallel=False):
    """The course GPT's ``Block``, tensor parallel over ``group``, in place:
    attention by heads, MLP column-then-row (``BLOCK_PLAN``). Returns the block.

    With ``sequence_parallel`` the block takes and returns (b, s/t, h) (see
    :mod:`course_lib.tp.sequence`); its LayerNorms and row biases are flagged for
    :func:`~course_lib.tp.sequence.sync_sequence_parallel_grads`."""
    parallelize(block, BLOCK_PLAN if plan is None else plan, group, collectives,
                sequence_parallel)
    if sequence_parallel:
        for sub in block.modules():
            if isinstance(sub, nn.LayerNorm):
                mark_sequence_parallel(*sub.parameters())
            elif isinstance(sub, RowParallelLinear) and sub.bias is not None:
                mark_sequence_parallel(sub.bias)
    return block
