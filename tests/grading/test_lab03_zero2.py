"""Lab 03's ZeRO-2 check (3.11): pass a student's class, fail the stub and these wrong
answers with the reason, judged as the gradebook judges."""
import pytest
import torch
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib.collectives import collective_ops
from course_lib.grading import checks, lab03_zero2

ship_by_value(__name__)


def shard_bounds(numel, rank, world):
    padded = max(-(-numel // world) * world, world)
    size = padded // world
    return rank * size, (rank + 1) * size, padded


class ZeRO2:
    """A student's ZeRO-2: gradients reduce-scattered, the shard stepped, shards gathered."""

    def __init__(self, params, make_optimizer, group=None):
        self.params, self.group = list(params), group
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.end, self.padded = shard_bounds(
            self.numel, dist.get_rank(group), dist.get_world_size(group))
        flat = torch.zeros(self.padded)
        flat[:self.numel] = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard = torch.nn.Parameter(flat[self.start:self.end].clone())
        self.optimizer = make_optimizer([self.shard])

    def flat_grad(self):
        flat = torch.zeros(self.padded)
        flat[:self.numel] = torch.cat([p.grad.reshape(-1) for p in self.params])
        for p in self.params:
            p.grad = None
        return flat

    def reduce_gradients(self):
        grad = torch.empty(self.end - self.start)
        collective_ops().reduce_scatter(grad, self.flat_grad(), group=self.group)
        self.shard.grad = grad / dist.get_world_size(self.group)

    def gather(self):
        full = torch.empty(self.padded)
        collective_ops().all_gather(full, self.shard.detach(), group=self.group)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def step(self):
        self.reduce_gradients()
        self.optimizer.step()
        self.gather()

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class AllReduceZeRO2(ZeRO2):
    """ZeRO-1's way: the whole gradient all-reduced, then sliced."""

    def reduce_gradients(self):
        flat = self.flat_grad()
        collective_ops().all_reduce(flat, group=self.group)
        self.shard.grad = flat[self.start:self.end] / dist.get_world_size(self.group)


class SummedZeRO2(ZeRO2):
    def reduce_gradients(self):
        grad = torch.empty(self.end - self.start)
        collective_ops().reduce_scatter(grad, self.flat_grad(), group=self.group)
        self.shard.grad = grad


class UngatheredZeRO2(ZeRO2):
    """Copies only its own updated shard back: the other ranks' parts go stale."""

    def gather(self):
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        flat[self.start:min(self.end, self.numel)] = self.shard.detach()[:max(
            0, min(self.end, self.numel) - self.start)]
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


class WholeModelZeRO2(ZeRO2):
    """Reduce-scatters and gathers the gradient, then steps every parameter."""

    def __init__(self, params, make_optimizer, group=None):
        super().__init__(params, lambda shard: None, group)
        self.optimizer = make_optimizer(self.params)

    def step(self):
        grad = torch.empty(self.end - self.start)
        collective_ops().reduce_scatter(grad, self.flat_grad(), group=self.group)
        full = torch.empty(self.padded)
        collective_ops().all_gather(full, grad / dist.get_world_size(self.group),
                                    group=self.group)
        offset = 0
        for p in self.params:
            p.grad = full[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()


class KeepingGradsZeRO2(ZeRO2):
    def step(self):
        grads = [p.grad.clone() for p in self.params]
        super().step()
        for p, g in zip(self.params, grads):
            p.grad = g


def test_a_students_zero2_passes(sandbox, capsys):
    lab03_zero2.check_zero2(ZeRO2, world_sizes=(3,))
    assert "✓ Exercise 3.11 passed" in capsys.readouterr().out
    assert "passed" in judged(sandbox, lab03_zero2.check_zero2, ZeRO2, world_sizes=(2,), seed=7)


@pytest.mark.parametrize("wrong,fragment", [
    (AllReduceZeRO2, "ZeRO-2 reduce-scatters the flat gradient"),
    (SummedZeRO2, "divide the shard by the world size"),
    (UngatheredZeRO2, "expected 3 reduce-scatters and 3 all-gathers"),
    (WholeModelZeRO2, "each rank steps only its shard"),
    (KeepingGradsZeRO2, "still hold"),
])
def test_wrong_zero2s_fail_with_the_reason(wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab03_zero2.check_zero2, wrong, world_sizes=(2,))


def test_the_stub_fails_and_the_library_passes_unless_guarded(sandbox, capsys):
    from course_lib.fsdp import ZeRO2 as LibraryZeRO2

    class Stub:
        def __init__(self, params, make_optimizer, group=None):
            raise NotImplementedError

        def step(self):
            raise NotImplementedError

    with pytest.raises(NotImplementedError, match="Exercise 3.11 is not implemented"):
        judged(sandbox, lab03_zero2.check_zero2, Stub, world_sizes=(2,))
    lab03_zero2.check_zero2(LibraryZeRO2, world_sizes=(2,))  # the hidden tests, passed
    assert "✓ Exercise 3.11 passed" in capsys.readouterr().out
    checks.guard_references(True)
    try:
        with pytest.raises(checks.CheckFailed, match="course_lib.fsdp.zero2.ZeRO2"):
            lab03_zero2.check_zero2(LibraryZeRO2)
    finally:
        checks.guard_references(None)
