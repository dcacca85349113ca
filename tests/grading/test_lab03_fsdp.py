"""Lab 03's FSDP-unit checks (3.5-3.8): pass the solutions, fail the stubs and these wrong answers."""
import random
import math

import pytest
import torch
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib.collectives import collective_ops
from course_lib.grading import checks, lab03_fsdp

ship_by_value(__name__)


def flatten_and_shard(tensors, rank, world):
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    padded = max(math.ceil(flat.numel() / world) * world, world)
    flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    size = padded // world
    return flat[rank * size:(rank + 1) * size].clone(), padded


def flatten_and_shard_view(tensors, rank, world):
    """Right values, but each shard is a view that keeps the whole buffer alive."""
    numel = sum(t.numel() for t in tensors)
    padded = max(math.ceil(numel / world) * world, world)
    flat = torch.zeros(padded)
    flat[:numel] = torch.cat([t.detach().reshape(-1) for t in tensors])
    size = padded // world
    return flat[rank * size:(rank + 1) * size], padded


def flatten_and_shard_no_padding(tensors, rank, world):
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    size = math.ceil(flat.numel() / world)
    return flat[rank * size:(rank + 1) * size].clone(), flat.numel()


class GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group):
        ctx.group = group
        full = shard.new_empty(shard.numel() * dist.get_world_size(group))
        collective_ops().all_gather(full, shard, group=group)
        return full

    @staticmethod
    def backward(ctx, grad_full):
        n = dist.get_world_size(ctx.group)
        grad = grad_full.new_empty(grad_full.numel() // n)
        collective_ops().reduce_scatter(grad, grad_full.contiguous(), group=ctx.group)
        return grad / n, None


class GatherShardsSummed(GatherShards):
    """Forgets to average: each rank's gradient is n times too large."""

    @staticmethod
    def backward(ctx, grad_full):
        grad = grad_full.new_empty(grad_full.numel() // dist.get_world_size(ctx.group))
        collective_ops().reduce_scatter(grad, grad_full.contiguous(), group=ctx.group)
        return grad, None


class GatherShardsAllReduce(GatherShards):
    """Right values, twice the bytes: all-reduces the whole gradient, then slices it."""

    @staticmethod
    def backward(ctx, grad_full):
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        grad = grad_full.contiguous().clone()
        collective_ops().all_reduce(grad, group=ctx.group)
        size = grad.numel() // n
        return grad[rank * size:(rank + 1) * size] / n, None


def free_between_passes(full, regather):
    storage = full.untyped_storage().data_ptr()

    def pack(t):
        if t.untyped_storage().data_ptr() == storage:
            return ("full", t.storage_offset(), t.size(), t.stride())
        return t

    def unpack(saved):
        if isinstance(saved, tuple):
            regather()
            return full.detach().as_strided(saved[2], saved[3], saved[1])
        return saved

    return pack, unpack


def keep_everything(full, regather):
    return (lambda t: t), (lambda t: t)


def free_between_passes_keeping_a_copy(full, regather):
    """Passes the training comparison, but keeps a full copy: nothing is saved."""
    storage = full.untyped_storage().data_ptr()

    def pack(t):
        return ("copy", t.clone()) if t.untyped_storage().data_ptr() == storage else t

    def unpack(saved):
        if isinstance(saved, tuple):
            regather()
            return saved[1]
        return saved

    return pack, unpack


def free_between_passes_no_regather(full, regather):
    pack, unpack = free_between_passes(full, lambda: None)
    return pack, unpack


def units_to_prefetch(order, current, depth, backward):
    at = order.index(current)
    return order[max(0, at - depth):at][::-1] if backward else order[at + 1:at + 1 + depth]


def units_to_prefetch_forward_only(order, current, depth, backward):
    at = order.index(current)
    return order[at + 1:at + 1 + depth]


def units_to_prefetch_farthest_first(order, current, depth, backward):
    at = order.index(current)
    return order[max(0, at - depth):at] if backward else order[at + 1:at + 1 + depth]


def test_solutions_pass(capsys):
    lab03_fsdp.check_flatten_and_shard(flatten_and_shard)
    lab03_fsdp.check_gather_shards(GatherShards)
    lab03_fsdp.check_free_between_passes(free_between_passes)
    lab03_fsdp.check_prefetch_plan(units_to_prefetch)
    for check, solution in ((lab03_fsdp.check_flatten_and_shard, flatten_and_shard),
                            (lab03_fsdp.check_prefetch_plan, units_to_prefetch)):
        check(solution, **check.hidden(random.Random(5)))  # the gradebook's hidden cases
    out = capsys.readouterr().out
    for ex in ("3.5", "3.6", "3.7", "3.8"):
        assert f"✓ Exercise {ex} passed" in out


@pytest.mark.parametrize("check,wrong,fragment", [
    (lab03_fsdp.check_flatten_and_shard, flatten_and_shard_no_padding, "padded size"),
    (lab03_fsdp.check_flatten_and_shard, flatten_and_shard_view, r"\.clone\(\) the slice"),
    (lab03_fsdp.check_free_between_passes, keep_everything, "pack returned the view"),
    (lab03_fsdp.check_free_between_passes, free_between_passes_keeping_a_copy, "a copy of the"),
    (lab03_fsdp.check_free_between_passes, free_between_passes_no_regather,
     "did not call regather"),
    (lab03_fsdp.check_prefetch_plan, units_to_prefetch_forward_only, "in backward the units run"),
    (lab03_fsdp.check_prefetch_plan, units_to_prefetch_farthest_first, "nearest unit computes"),
])
def test_wrong_answers_in_process_get_a_hint(check, wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, check, wrong)


@pytest.mark.parametrize("wrong,fragment", [
    (GatherShardsSummed, "3.00x the expected one"),
    (GatherShardsAllReduce, "all-reduced the whole gradient"),
])
def test_wrong_gathers_are_caught_with_a_reason(wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab03_fsdp.check_gather_shards, wrong, world_sizes=(3,))


def test_stubs_say_not_implemented(sandbox):
    def stub(*args):
        raise NotImplementedError

    class StubGather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, shard, group):
            raise NotImplementedError

    for check, fn, ex in ((lab03_fsdp.check_flatten_and_shard, stub, "3.5"),
                          (lab03_fsdp.check_free_between_passes, stub, "3.7"),
                          (lab03_fsdp.check_prefetch_plan, stub, "3.8")):
        with pytest.raises(NotImplementedError, match=f"Exercise {ex} is not implemented"):
            check(fn)
    with pytest.raises(NotImplementedError, match="Exercise 3.6 is not implemented"):
        judged(sandbox, lab03_fsdp.check_gather_shards, StubGather, world_sizes=(2,))
