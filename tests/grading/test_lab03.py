"""Lab 03's checks: pass the solutions, fail the stubs and these wrong answers."""
import random
import pytest
import torch
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib.grading import checks, lab03
from course_lib.runtime.backend import builtin_all_gather

ship_by_value(__name__)


def param_count(V, D, T, N):
    return N * (12 * D * D + 10 * D) + D * (V + T) + 2 * D + V * (D + 1)


def param_count_no_output_bias(V, D, T, N):
    return N * (12 * D * D + 10 * D) + D * (V + T) + 2 * D + V * D


def zero_bytes(P, n, stage):
    params, grads, state = 2 * P, 2 * P, 12 * P
    return (params / (n if stage >= 3 else 1) + grads / (n if stage >= 2 else 1)
            + state / (n if stage >= 1 else 1))


def zero_bytes_notes_14p(P, n, stage):  # the lecture's 14P: no gradients
    return (2 * P / (n if stage >= 3 else 1) + 12 * P / (n if stage >= 1 else 1))


def shard_bounds(numel, rank, world):
    padded = max(-(-numel // world) * world, world)
    size = padded // world
    return rank * size, (rank + 1) * size, padded


def shard_bounds_no_padding(numel, rank, world):
    size = numel // world
    return rank * size, (rank + 1) * size, numel


def zero1_step(params, shard, optimizer):
    world, rank = dist.get_world_size(), dist.get_rank()
    size = shard.numel()
    flat = torch.zeros(size * world)
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    flat[:grads.numel()] = grads
    shard.grad = flat[rank * size:(rank + 1) * size].clone()
    optimizer.step()
    full = torch.empty(size * world)
    builtin_all_gather(full, shard.detach())
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def zero1_step_no_gather(params, shard, optimizer):
    """Updates only this rank's slice of the parameters: the others go stale."""
    world, rank = dist.get_world_size(), dist.get_rank()
    size = shard.numel()
    flat = torch.zeros(size * world)
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    flat[:grads.numel()] = grads
    shard.grad = flat[rank * size:(rank + 1) * size].clone()
    optimizer.step()
    full = torch.cat([p.detach().reshape(-1) for p in params] + [torch.zeros(flat.numel() - grads.numel())])
    full[rank * size:(rank + 1) * size] = shard.detach()
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def test_solutions_pass(capsys):
    lab03.check_param_count(param_count)
    lab03.check_zero_bytes(zero_bytes)
    lab03.check_shard_bounds(shard_bounds)
    for check, solution in ((lab03.check_param_count, param_count), (lab03.check_zero_bytes, zero_bytes),
                            (lab03.check_shard_bounds, shard_bounds)):
        check(solution, **check.hidden(random.Random(5)))  # the gradebook's hidden cases
    lab03.check_zero1_step(zero1_step, world_sizes=(1, 3))
    out = capsys.readouterr().out
    for ex in ("3.1", "3.2", "3.3", "3.4"):
        assert f"✓ Exercise {ex} passed" in out


@pytest.mark.parametrize("check,wrong,fragment", [
    (lab03.check_param_count, param_count_no_output_bias, "you left out the output bias, V"),
    (lab03.check_zero_bytes, zero_bytes_notes_14p, "stage 0 is DDP: 2P \\+ 2P \\+ 12P"),
    (lab03.check_shard_bounds, shard_bounds_no_padding, "pad the flat buffer"),
])
def test_wrong_formulas_get_a_hint(check, wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, check, wrong)


def test_a_zero1_step_without_all_gather_fails(sandbox):
    with pytest.raises(checks.CheckFailed, match="a step of yours sent nothing and called no collective"):
        judged(sandbox, lab03.check_zero1_step, zero1_step_no_gather, world_sizes=(2,))


def test_stubs_say_not_implemented(sandbox):
    def stub(*args):
        raise NotImplementedError

    for check, ex in ((lab03.check_param_count, "3.1"), (lab03.check_zero_bytes, "3.2"),
                      (lab03.check_shard_bounds, "3.3")):
        with pytest.raises(NotImplementedError, match=f"Exercise {ex} is not implemented"):
            check(stub)
    with pytest.raises(NotImplementedError, match="Exercise 3.4 is not implemented"):
        judged(sandbox, lab03.check_zero1_step, stub, world_sizes=(2,))
