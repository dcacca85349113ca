"""Lab 05's checks: pass the solutions, fail the stubs and these plausible wrong answers."""
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import all_reduce as imported_all_reduce

from conftest import judged, ship_by_value
from course_lib.grading import checks, lab05

ship_by_value(__name__)


# ---- 5.1 -------------------------------------------------------------------------------
def column_parallel_matmul(X, A, t):
    return [X @ A_i for A_i in A.chunk(t, dim=1)]


def row_parallel_matmul(X, A, t):
    return [X_i @ A_i for X_i, A_i in zip(X.chunk(t, dim=1), A.chunk(t, dim=0))]


def row_parallel_by_batch(X, A, t):  # splits the batch: data parallelism
    return [X_i @ A for X_i in X.chunk(t, dim=0)]


def column_parallel_by_rows(X, A, t):  # cuts A's rows and X's columns: a row split
    return [X_i @ A_i for X_i, A_i in zip(X.chunk(t, dim=1), A.chunk(t, dim=0))]


# ---- 5.2 -------------------------------------------------------------------------------
class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceBothWays(torch.autograd.Function):  # g that also all-reduces its gradient
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class CopyToWorld(torch.autograd.Function):  # f that forgets its group
    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad, None


class ReduceInPlace(torch.autograd.Function):  # g that all-reduces its input in place
    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class CopyGradInPlace(torch.autograd.Function):  # f that all-reduces the incoming gradient
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class CopyImported(torch.autograd.Function):  # right, but calls an all_reduce imported by name
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        imported_all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceImported(torch.autograd.Function):  # right, but calls an all_reduce imported by name
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        imported_all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ---- 5.3 -------------------------------------------------------------------------------
class ParallelMLP(nn.Module):
    def __init__(self, mlp, group=None):
        super().__init__()
        self.group = group
        t, r = dist.get_world_size(group), dist.get_rank(group)
        fc1, fc2 = mlp[0], mlp[2]
        self.w1 = nn.Parameter(fc1.weight.detach().chunk(t, dim=0)[r].clone())
        self.b1 = nn.Parameter(fc1.bias.detach().chunk(t, dim=0)[r].clone())
        self.w2 = nn.Parameter(fc2.weight.detach().chunk(t, dim=1)[r].clone())
        self.b2 = nn.Parameter(fc2.bias.detach().clone())

    def forward(self, x):
        x = CopyToTP.apply(x, self.group)
        h = F.gelu(F.linear(x, self.w1, self.b1))
        return ReduceFromTP.apply(F.linear(h, self.w2), self.group) + self.b2


class BiasOnEveryRank(ParallelMLP):
    def forward(self, x):
        x = CopyToTP.apply(x, self.group)
        h = F.gelu(F.linear(x, self.w1, self.b1))
        return ReduceFromTP.apply(F.linear(h, self.w2, self.b2), self.group)


class SecondLayerByRows(ParallelMLP):
    def __init__(self, mlp, group=None):
        super().__init__(mlp, group)
        t, r = dist.get_world_size(group), dist.get_rank(group)
        self.w2 = nn.Parameter(mlp[2].weight.detach().chunk(t, dim=0)[r].clone())


class NoF(ParallelMLP):
    def forward(self, x):
        h = F.gelu(F.linear(x, self.w1, self.b1))
        return ReduceFromTP.apply(F.linear(h, self.w2), self.group) + self.b2


class KeepsTheDenseMLP(ParallelMLP):  # keeps the dense layers as a submodule
    def __init__(self, mlp, group=None):
        super().__init__(mlp, group)
        self.dense = mlp


class BiasNotAParameter(ParallelMLP):  # b2 as a plain tensor attribute
    def __init__(self, mlp, group=None):
        super().__init__(mlp, group)
        del self.b2
        self.b2 = mlp[2].bias.detach().clone()


class ImportedAllReduce(ParallelMLP):  # right, with f and g that call an imported all_reduce
    def forward(self, x):
        x = CopyImported.apply(x, self.group)
        h = F.gelu(F.linear(x, self.w1, self.b1))
        return ReduceImported.apply(F.linear(h, self.w2), self.group) + self.b2


# ---- 5.4 -------------------------------------------------------------------------------
def shard_qkv(weight, heads, rank, t):
    if heads % t:
        raise ValueError(f"{heads} heads do not split over t = {t} ranks")
    return torch.cat([part.chunk(t, dim=0)[rank] for part in weight.chunk(3, dim=0)])


def shard_qkv_contiguous(weight, heads, rank, t):
    if heads % t:
        raise ValueError(f"{heads} heads do not split over t = {t} ranks")
    return weight.chunk(t, dim=0)[rank]


def shard_qkv_no_check(weight, heads, rank, t):
    return torch.cat([part.chunk(t, dim=0)[rank] for part in weight.chunk(3, dim=0)])


# ---- 5.5 -------------------------------------------------------------------------------
def layer_volume(m, k, n, gx, gy, gz):
    weights = (gz - 1) / gz * k * n / (gx * gy)
    forward = weights + 2 * (gx - 1) / gx * (m / gz) * (n / gy)
    backward = 2 * (gy - 1) / gy * (m / gz) * (k / gx) + weights
    return forward + backward


def layer_volume_forward_only(m, k, n, gx, gy, gz):
    return (gz - 1) / gz * k * n / (gx * gy) + 2 * (gx - 1) / gx * (m / gz) * (n / gy)


def layer_volume_without_ring_factors(m, k, n, gx, gy, gz):
    weights = k * n / (gx * gy) if gz > 1 else 0
    return (2 * weights + (2 * m / gz * n / gy if gx > 1 else 0)
            + (2 * m / gz * k / gx if gy > 1 else 0))


def layer_volume_gathers_twice(m, k, n, gx, gy, gz):  # all-gathers A again in backward
    return layer_volume(m, k, n, gx, gy, gz) + (gz - 1) / gz * k * n / (gx * gy)


def layer_volume_no_weight_traffic(m, k, n, gx, gy, gz):
    return 2 * (gx - 1) / gx * (m / gz) * (n / gy) + 2 * (gy - 1) / gy * (m / gz) * (k / gx)


def test_solutions_pass(capsys):
    lab05.check_split_matmul(column_parallel_matmul, row_parallel_matmul)
    lab05.check_f_and_g(CopyToTP, ReduceFromTP)
    lab05.check_parallel_mlp(ParallelMLP)
    lab05.check_shard_qkv(shard_qkv)
    lab05.check_layer_volume(layer_volume)
    for check, solution in ((lab05.check_split_matmul, (column_parallel_matmul, row_parallel_matmul)),
                            (lab05.check_shard_qkv, (shard_qkv,)),
                            (lab05.check_layer_volume, (layer_volume,))):
        for seed in range(3):  # the gradebook's hidden settings
            check(*solution, **check.hidden(random.Random(seed)))
    out = capsys.readouterr().out
    for ex in ("5.1", "5.2", "5.3", "5.4", "5.5"):
        assert f"✓ Exercise {ex} passed" in out


@pytest.mark.parametrize("column,row,fragment", [
    (column_parallel_matmul, row_parallel_by_batch, "that is data parallelism"),
    (column_parallel_by_rows, row_parallel_matmul, "a column split gives GPU i the columns"),
])
def test_wrong_splits_by_hand_get_a_hint(column, row, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab05.check_split_matmul, column, row)


@pytest.mark.parametrize("f,g,fragment", [
    (ReduceFromTP, CopyToTP, "Did you swap f and g"),
    (CopyToTP, ReduceBothWays, "g's backward is the identity"),
    (CopyToWorld, ReduceFromTP, "over the group you were given"),
    (CopyToTP, ReduceInPlace, "g changed its input X in place"),
    (CopyGradInPlace, ReduceFromTP, "f's backward changed the incoming gradient in place"),
    (CopyImported, ReduceFromTP, "the check counts calls to dist.all_reduce; call it as "
                                 "dist.all_reduce"),
    (CopyToTP, ReduceImported, "the check counts calls to dist.all_reduce; call it as "
                               "dist.all_reduce"),
])
def test_wrong_f_and_g_are_named(f, g, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab05.check_f_and_g, f, g, world_sizes=(3,))


@pytest.mark.parametrize("mlp,fragment", [
    (BiasOnEveryRank, "Add the row-parallel layer's bias once, after g"),
    (SecondLayerByRows, "(?s)w2, the second layer's weight, has shape .* split its columns"),
    (NoF, "X goes through f"),
    (KeepsTheDenseMLP,
     "(?s)unexpected parameter\\(s\\) dense.0.bias, dense.0.weight, .*Keep no submodule"),
    (BiasNotAParameter, "missing parameter\\(s\\) b2 \\(the second layer's bias\\)"),
    (ImportedAllReduce, "the check counts calls to dist.all_reduce; call it as dist.all_reduce"),
])
def test_wrong_parallel_mlps_are_named(mlp, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab05.check_parallel_mlp, mlp, world_sizes=(2,))


@pytest.mark.parametrize("shard,fragment", [
    (shard_qkv_contiguous, "is a contiguous 1/2 of the fused weight"),
    (shard_qkv_no_check, "expected a ValueError"),
])
def test_wrong_qkv_slices_are_named(shard, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab05.check_shard_qkv, shard, world_sizes=(2,))


@pytest.mark.parametrize("wrong,fragment", [
    (layer_volume_forward_only, "forward pass only"),
    (layer_volume_without_ring_factors, "include the \\(p-1\\)/p"),
    (layer_volume_no_weight_traffic, "sharded over gz"),
    (layer_volume_gathers_twice, "kept from forward to backward"),
])
def test_wrong_volumes_get_a_hint(wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab05.check_layer_volume, wrong)


def test_stubs_say_not_implemented():
    def stub(*args, **kwargs):
        raise NotImplementedError

    class StubFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            raise NotImplementedError

    class StubMLP(nn.Module):
        def __init__(self, mlp, group=None):
            raise NotImplementedError

    cases = [(lambda: lab05.check_split_matmul(stub, stub), "5.1"),
             (lambda: lab05.check_shard_qkv(stub), "5.4"),
             (lambda: lab05.check_layer_volume(stub), "5.5"),
             (lambda: lab05.check_f_and_g(StubFunction, StubFunction, world_sizes=(2,)), "5.2"),
             (lambda: lab05.check_parallel_mlp(StubMLP, world_sizes=(2,)), "5.3")]
    for check, ex in cases:
        with pytest.raises(NotImplementedError, match=f"Exercise {ex} is not implemented"):
            check()
