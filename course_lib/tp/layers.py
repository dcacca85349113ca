"""Column- and row-parallel linear layers: each rank holds one block of the weight.

In Megatron's notation a linear layer computes Y = X A (+ b) with A of shape
(in, out). ``nn.Linear`` stores ``weight = A^T``, shape (out, in), so:

- **column parallel**, A = [A_1 ... A_t] (split by columns, the output dim):
  rank r holds ``weight`` rows and ``bias`` entries r*out/t ... (r+1)*out/t.
  Y_r = f(X) A_r + b_r is rank r's block of Y = [Y_1 ... Y_t]; X is replicated,
  so f (identity forward, all-reduce of dX backward) comes first.
- **row parallel**, A = [A_1; ...; A_t] (split by rows, the input dim), fed
  X = [X_1 ... X_t]: rank r holds ``weight`` columns r*in/t ... (r+1)*in/t.
  Y = g(sum_r X_r A_r) + b: the partial sums are all-reduced by g, and the bias,
  held whole on every rank, is added once, after the sum (adding it before
  would count it t times).

A column-parallel layer's output (each rank's block Y_r) is exactly the input a
row-parallel layer expects, so the pair needs no communication in between.

Two ways to build a layer, giving the same slice:

    ColumnParallelLinear.from_dense(linear, group=tp)      # cut an existing nn.Linear
    ColumnParallelLinear(64, 256, group=tp, name="blocks.0.mlp.0", seed=0)

The second draws the full tensor of ``param_by_name`` (the course's name-seeded
initialisation) and keeps only its slice, so a rank built alone holds exactly
what ``from_dense`` would cut from the whole model. Neither keeps the dense
weight: each parameter is a fresh tensor of the slice's size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.models import param_by_name
from course_lib.runtime.backend import current_device
from course_lib.tp.operators import (check_divides, copy_to_tp, gather_from_tp, ops_for,
                                     reduce_from_tp, split_to_tp, tp_size_and_rank)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "column_shard", "row_shard"]


def column_shard(full, rank, t, parts=1):
    """Rank ``rank``'s rows of ``full`` (a weight (out, in) or a bias (out,)) under
    a column split of A. ``parts`` > 1: the output is that many blocks side by
    side (a fused q/k/v projection: parts=3), each split on its own, so rank r
    gets block r of every part (its heads' q, k and v), not a contiguous 1/t."""
    out = full.shape[0]
    check_divides(out, parts * t, "out_features" if parts == 1 else f"out_features / {parts}")
    blocks = full.reshape(parts, t, out // (parts * t), *full.shape[1:])
    # one copy (reshape-then-clone copies twice when parts > 1): the slice is all it allocates
    return blocks[:, rank].clone(memory_format=torch.contiguous_format).view(out // t,
                                                                            *full.shape[1:])


def row_shard(weight, rank, t):
    """Rank ``rank``'s columns of ``weight`` (out, in) under a row split of A."""
    check_divides(weight.shape[1], t, "in_features")
    return weight.chunk(t, dim=1)[rank].clone()


def _prefix(name):
    return f"{name}." if name else ""


class _ParallelLinear(nn.Module):
    """What both layers share: the group, the sizes, building from a dense layer."""

    def __init__(self, in_features, out_features, group, collectives, device, dtype):
        super().__init__()
        self.t, self.rank = tp_size_and_rank(group)
        ops_for(collectives)  # an unknown kind fails at construction
        self.group, self.collectives = group, collectives
        self.in_features, self.out_features = in_features, out_features  # the dense sizes
        self._factory = {"device": current_device() if device is None else device,
                         "dtype": dtype}

    def _init_by_name(self, name, seed):
        """Give the slice its values under the course's name-seeded initialisation."""
        if self.weight.device.type == "meta":
            return
        shape = (self.out_features, self.in_features)
        full_w = param_by_name(_prefix(name) + "weight", shape, seed)
        full_b = param_by_name(_prefix(name) + "bias", (self.out_features,), seed)
        self._load(full_w, full_b if self.bias is not None else None)

    @classmethod
    def _from_dense(cls, linear, **kwargs):
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_dense takes an nn.Linear, got "
                            f"{type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    device="meta", dtype=linear.weight.dtype, **kwargs)
        layer.to_empty(device=linear.weight.device)
        layer._load(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        layer.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer

    @torch.no_grad()
    def _load(self, full_weight, full_bias):
        self.weight.copy_(self.shard_weight(full_weight))
        if full_bias is not None:
            self.bias.copy_(self.shard_bias(full_bias))

    @torch.no_grad()
    def dense_state(self):
        """{"weight", "bias"}: the dense layer's full tensors, put back together
        from every rank's slice by an all-gather over the group (uncounted: it
        is for checking and saving, not part of a training step). Every rank
        of the group must call it."""
        return {name: self._unshard(name, tensor) for name, tensor in
                (("weight", self.weight), ("bias", self.bias)) if tensor is not None}

    def _gather(self, tensor):
        if self.t == 1:
            return [tensor.detach().clone()]
        pieces = [torch.empty_like(tensor) for _ in range(self.t)]
        dist.all_gather(pieces, tensor.detach().contiguous(), group=self.group)
        return pieces

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, t={self.t}, rank={self.rank}, "
                f"local weight={tuple(self.weight.shape)}")


class ColumnParallelLinear(_ParallelLinear):
    """Y_r = f(X) A_r + b_r: weight (out/t, in), bias (out/t,) on each rank.
    ``gather_output=True`` all-gathers [Y_1 ... Y_t] (..., out) at the end;
    otherwise each rank returns its own block (..., out/t)."""

    def __init__(self, in_features, out_features, bias=True, *, group=None,
                 gather_output=False, collectives="torch", name="", seed=0, parts=1,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, group, collectives, device, dtype)
        check_divides(out_features, parts * self.t,
                      "out_features" if parts == 1 else f"out_features / {parts}")
        self.gather_output, self.parts = gather_output, parts
        self.weight = nn.Parameter(torch.empty(out_features // self.t, in_features,
                                               **self._factory))
        self.bias = (nn.Parameter(torch.empty(out_features // self.t, **self._factory))
                     if bias else None)
        self._init_by_name(name, seed)

    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False, collectives="torch", parts=1):
        """This rank's block of ``linear``'s columns of A (rows of its weight)."""
        return cls._from_dense(linear, group=group, gather_output=gather_output,
                               collectives=collectives, parts=parts)

    def shard_weight(self, full):
        """This rank's slice of the dense layer's (out, in) weight (or its gradient)."""
        return column_shard(full, self.rank, self.t, self.parts)

    def shard_bias(self, full):
        """This rank's slice of the dense layer's (out,) bias."""
        return column_shard(full, self.rank, self.t, self.parts)

    def _unshard(self, name, tensor):
        # slice r holds block r of every part: stack the ranks inside each part
        pieces = self._gather(tensor)
        tail = tensor.shape[1:]
        blocks = torch.stack([p.reshape(self.parts, -1, *tail) for p in pieces], dim=1)
        return blocks.reshape(self.out_features, *tail)

    def local(self, x):
        """X A_r + b_r on an X that has already been through f."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x):
        y = self.local(copy_to_tp(x, self.group, self.collectives))
        return gather_from_tp(y, self.group, self.collectives) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """Y = g(X_r A_r) + b: weight (out, in/t) on each rank, bias (out,) whole and
    added after g. With ``input_is_parallel=False`` it takes the full X and
    splits it first (backward: all-gather of dX)."""

    def __init__(self, in_features, out_features, bias=True, *, group=None,
                 input_is_parallel=True, collectives="torch", name="", seed=0,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, group, collectives, device, dtype)
        check_divides(in_features, self.t, "in_features")
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.t,
                                               **self._factory))
        self.bias = nn.Parameter(torch.empty(out_features, **self._factory)) if bias else None
        self._init_by_name(name, seed)

    @classmethod
    def from_dense(cls, linear, group=None, input_is_parallel=True, collectives="torch"):
        """This rank's block of ``linear``'s rows of A (columns of its weight)."""
        return cls._from_dense(linear, group=group, input_is_parallel=input_is_parallel,
                               collectives=collectives)

    def shard_weight(self, full):
        """This rank's slice of the dense layer's (out, in) weight (or its gradient)."""
        return row_shard(full, self.rank, self.t)

    def shard_bias(self, full):
        """The whole bias: every rank holds it."""
        return full.clone()

    def _unshard(self, name, tensor):
        return torch.cat(self._gather(tensor), dim=1) if name == "weight" else tensor.detach().clone()

    def partial(self, x):
        """X_r A_r: this rank's partial sum, before g and without the bias."""
        return F.linear(x, self.weight)

    def reduce(self, partial):
        """g(sum of the partial sums), then the bias, once."""
        y = reduce_from_tp(partial, self.group, self.collectives)
        return y if self.bias is None else y + self.bias

    def forward(self, x):
        if not self.input_is_parallel:
            x = split_to_tp(x, self.group, self.collectives)
        return self.reduce(self.partial(x))
