"""Lab 02's checks under real torchrun: each passes the solution, fails the stub,
and fails the plausible wrong answers below with a message that names the mistake."""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conftest import ship_by_value
from course_lib.ddp.buckets import Bucket, assign_buckets
from course_lib.grading import checks, lab02

ship_by_value(__name__)


# ---- Exercise 2.1 -------------------------------------------------------------------
def average_right(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def average_forgot_divide(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def average_the_weights(model):
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()


@pytest.mark.parametrize("wrong,fragment", [
    (average_forgot_divide, "are 2.00x the expected ones"),
    (average_the_weights, "this rank's own gradients, not averaged"),
])
def test_average_gradients_names_the_mistake(wrong, fragment):
    lab02.check_average_gradients(average_right, world_sizes=(2,))
    with pytest.raises(checks.CheckFailed, match=fragment):
        lab02.check_average_gradients(wrong, world_sizes=(2,))


# ---- Exercise 2.3 -------------------------------------------------------------------
class StudentDDP(nn.Module):
    """The notebook's BucketedDDP; ``launch_policy`` picks the hook's body."""

    def __init__(self, module, bucket_cap_mb, launch_policy="in_order"):
        super().__init__()
        self.module, self.world, self.policy = module, dist.get_world_size(), launch_policy
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)
        params = [p for p in module.parameters() if p.requires_grad]
        plan = assign_buckets([p.numel() * p.element_size() for p in params],
                              int(bucket_cap_mb * 2**20))
        self.buckets = [Bucket(i, [params[j] for j in idx]) for i, idx in enumerate(plan)]
        self.where = {id(p): (b, slot) for b in self.buckets for slot, p in enumerate(b.params)}
        self.next_bucket, self.launched, self.queued = 0, [], False
        for p in params:
            p.register_post_accumulate_grad_hook(self.hook)

    def forward(self, *args):
        return self.module(*args)

    def _start(self, bucket):
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        self.launched.append(bucket.index)

    def hook(self, param):
        if not self.queued:
            self.queued, self.launched = True, []
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        bucket, slot = self.where[id(param)]
        bucket.mark_ready(slot, param.grad, self.world)
        if self.policy == "in_order":
            while (self.next_bucket < len(self.buckets)
                   and self.buckets[self.next_bucket].complete):
                self._start(self.buckets[self.next_bucket])
                self.next_bucket += 1
        elif self.policy == "completion_order":
            if bucket.complete:
                self._start(bucket)
        elif self.policy == "at_the_end":
            if all(b.complete for b in self.buckets):
                for b in self.buckets:
                    self._start(b)

    def finish(self):
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.write_back()
            bucket.reset()
        self.next_bucket, self.queued = 0, False


def student(policy):
    return lambda module, cap: StudentDDP(module, cap, policy)


def test_bucketed_ddp_check_passes_the_solution(capsys):
    lab02.check_bucketed_ddp(student("in_order"), world_sizes=(1, 3))
    assert "✓ Exercise 2.3 passed" in capsys.readouterr().out


@pytest.mark.parametrize("policy,fragment", [
    ("completion_order", r"launched the buckets in the order \[1, 0, 2, 3\], the order they "
                         r"completed"),
    ("at_the_end", "launched no bucket before the last gradient hook fired"),
])
def test_bucketed_ddp_check_names_the_mistake(policy, fragment):
    with pytest.raises(checks.CheckFailed, match=fragment):
        lab02.check_bucketed_ddp(student(policy), world_sizes=(2,))


# ---- Exercise 2.4 -------------------------------------------------------------------
def accumulate_right(model, opt, x, y, micro_batches):
    opt.zero_grad()
    pieces = list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))
    for i, (xs, ys) in enumerate(pieces):
        last = i == len(pieces) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = F.mse_loss(model(xs), ys) / micro_batches
        loss.backward()
    opt.step()


def accumulate_sum_of_means(model, opt, x, y, micro_batches):
    opt.zero_grad()
    pieces = list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))
    for i, (xs, ys) in enumerate(pieces):
        with contextlib.nullcontext() if i == len(pieces) - 1 else model.no_sync():
            loss = F.mse_loss(model(xs), ys)
        loss.backward()
    opt.step()


def accumulate_no_sync_around_backward_only(model, opt, x, y, micro_batches):
    opt.zero_grad()
    pieces = list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))
    for i, (xs, ys) in enumerate(pieces):
        loss = F.mse_loss(model(xs), ys) / micro_batches
        with contextlib.nullcontext() if i == len(pieces) - 1 else model.no_sync():
            loss.backward()
    opt.step()


def test_accumulation_check_passes_the_solution(capsys):
    lab02.check_accumulation(accumulate_right, world_sizes=(1, 3), micro_batches=(2, 4))
    assert "✓ Exercise 2.4 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,fragment", [
    (accumulate_sum_of_means, r"are 2.00x the expected ones"),
    (accumulate_no_sync_around_backward_only, "all-reduced the gradients 2 times"),
])
def test_accumulation_check_names_the_mistake(wrong, fragment):
    with pytest.raises(checks.CheckFailed, match=fragment):
        lab02.check_accumulation(wrong, world_sizes=(2,), micro_batches=(2,))


# ---- Exercise 2.5 -------------------------------------------------------------------
def hook_right(process_group, bucket):
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(process_group))
    fut = dist.all_reduce(compressed, group=process_group, async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def hook_fp32(process_group, bucket):
    tensor = bucket.buffer().div_(dist.get_world_size(process_group))
    return dist.all_reduce(tensor, group=process_group, async_op=True).get_future()


def hook_no_divide(process_group, bucket):
    buffer = bucket.buffer()
    fut = dist.all_reduce(buffer.to(torch.bfloat16), async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def hook_returns_bf16(process_group, bucket):
    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size(process_group))
    return dist.all_reduce(compressed, async_op=True).get_future()


def test_bf16_hook_check_passes_the_solution(capsys):
    lab02.check_bf16_hook(hook_right, world_sizes=(1, 3))
    assert "✓ Exercise 2.5 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,fragment", [
    (hook_fp32, "not bfloat16 numbers"),
    (hook_no_divide, "is 2.00x the average"),
    (hook_returns_bf16, "shape and dtype of the reduced bucket"),
])
def test_bf16_hook_check_names_the_mistake(wrong, fragment):
    with pytest.raises(checks.CheckFailed, match=fragment):
        lab02.check_bf16_hook(wrong, world_sizes=(2,))


def test_stubs_say_not_implemented():
    def stub(*args):
        raise NotImplementedError

    with pytest.raises(NotImplementedError, match="Exercise 2.2 is not implemented"):
        lab02.check_assign_buckets(stub)  # checked in this process, not on ranks
    assert checks.outcome("Exercise 2.2") == "failed"
    with pytest.raises(NotImplementedError, match="Exercise 2.4 is not implemented"):
        lab02.check_accumulation(stub, world_sizes=(2,), micro_batches=(2,))
    with pytest.raises(NotImplementedError, match="Exercise 2.5 is not implemented"):
        lab02.check_bf16_hook(stub, world_sizes=(2,))
    assert not checks.ready("Exercise 2.5")
