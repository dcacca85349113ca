"""Lab 02's checks under real torchrun: each passes the solution, fails the stub,
and fails the plausible wrong answers below with a message that names the mistake."""
import random
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conftest import judged, ship_by_value
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
def test_average_gradients_names_the_mistake(wrong, fragment, sandbox):
    lab02.check_average_gradients(average_right, world_sizes=(2,))
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab02.check_average_gradients, wrong, world_sizes=(2,))


# ---- Exercise 2.2 -------------------------------------------------------------------
def _walk(order, closes):
    """A bucket plan walking ``order``; ``closes(filled, size, cap)`` says whether
    the open bucket closes (after adding) or, with "before", before adding."""
    def assign(sizes, cap):
        buckets, current, filled = [], [], 0
        for index in order(len(sizes)):
            if closes == "before" and current and filled + sizes[index] > cap:
                buckets.append(current)
                current, filled = [], 0
            current.append(index)
            filled += sizes[index]
            if closes != "before" and closes(filled, cap):
                buckets.append(current)
                current, filled = [], 0
        return buckets + ([current] if current else [])
    return assign


backwards = lambda n: reversed(range(n))  # noqa: E731
buckets_right = _walk(backwards, lambda filled, cap: filled >= cap)
buckets_forward_order = _walk(range, lambda filled, cap: filled >= cap)
buckets_never_over_the_cap = _walk(backwards, "before")
buckets_strictly_over_the_cap = _walk(backwards, lambda filled, cap: filled > cap)


def buckets_dropping_the_rest(sizes, cap):
    buckets = buckets_right(sizes, cap)
    if buckets and sum(sizes[i] for i in buckets[-1]) < cap:
        buckets.pop()  # what is left after the walk never gets a bucket
    return buckets


def test_assign_buckets_check_passes_the_solution(capsys):
    lab02.check_assign_buckets(buckets_right)
    assert "✓ Exercise 2.2 passed" in capsys.readouterr().out
    lab02.check_assign_buckets(assign_buckets)  # the library's, with its defaults
    for seed in range(3):  # the gradebook's hidden cases
        lab02.check_assign_buckets(buckets_right, **lab02.check_assign_buckets.hidden(random.Random(seed)))


@pytest.mark.parametrize("wrong,fragment", [
    (buckets_forward_order, r"returned \[\[0, 1\], \[2, 3\]\]: the buckets list the parameters "
                            r"first to last, in forward order\.\nHint: .*from last to first"),
    (buckets_never_over_the_cap, r"(?s)bucket 0 \[2\] was closed holding 10 bytes, under the cap "
                                 r"of 50.*do not start a new bucket to stay under it"),
    (buckets_strictly_over_the_cap, r"(?s)bucket 0 \[3, 2, 1\] already held 80 bytes \(cap 80\) "
                                    r"before parameter 1 went in.*the test is >=, not >"),
    (buckets_dropping_the_rest, r"parameter\(s\) \[0\] are in no bucket\.\nHint: the last "
                                r"bucket takes whatever is left"),
])
def test_assign_buckets_check_names_the_mistake(wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab02.check_assign_buckets, wrong)
    assert checks.outcome("Exercise 2.2") == "failed"


def test_assign_buckets_random_trials_name_the_mistake_too(sandbox):
    # right on the hand-checked cases, wrong on some random one: over the cap when
    # a bucket reaches it exactly, but only for caps above 100
    def sloppy(sizes, cap):
        return (buckets_strictly_over_the_cap if cap > 100 else buckets_right)(sizes, cap)

    with pytest.raises(checks.CheckFailed, match=r"(?s)cap_bytes=\d{3}\) returned .*already "
                                                 r"held \d+ bytes.*before parameter"):
        judged(sandbox, lab02.check_assign_buckets, sloppy)


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
def test_bucketed_ddp_check_names_the_mistake(policy, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab02.check_bucketed_ddp, student(policy), world_sizes=(2,))


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


def accumulate_whole_batch(model, opt, x, y, micro_batches):
    """No micro-batches: one step on the whole batch gives the same gradient."""
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def test_accumulation_check_passes_the_solution(capsys):
    lab02.check_accumulation(accumulate_right, world_sizes=(1, 3), micro_batches=(2, 4))
    assert "✓ Exercise 2.4 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,fragment", [
    (accumulate_sum_of_means, r"are 2.00x the expected ones"),
    (accumulate_no_sync_around_backward_only, "all-reduced the gradients 2 times"),
    (accumulate_whole_batch, r"one step ran the model 1 time\(s\)"),
])
def test_accumulation_check_names_the_mistake(wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab02.check_accumulation, wrong, world_sizes=(2,), micro_batches=(2,))


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


_stale = {}


def hook_reusing_its_first_buffer(process_group, bucket):
    """Right on one bucket; keeps each bucket's first compressed copy "to save an
    allocation" and never refreshes it, so later steps average stale gradients."""
    buffer = bucket.buffer()
    key = (bucket.index(), buffer.numel())  # DDP rebuilds its buckets after step 1
    if key not in _stale:
        _stale[key] = buffer.to(torch.bfloat16).div_(dist.get_world_size(process_group))
    fut = dist.all_reduce(_stale[key].clone(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def test_bf16_hook_check_passes_the_solution(capsys):
    lab02.check_bf16_hook(hook_right, world_sizes=(1, 3))
    assert "✓ Exercise 2.5 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,fragment", [
    (hook_fp32, "not bfloat16 numbers"),
    (hook_no_divide, "is 2.00x the average"),
    (hook_returns_bf16, "shape and dtype of the reduced bucket"),
])
def test_bf16_hook_check_names_the_mistake(wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab02.check_bf16_hook, wrong, world_sizes=(2,))


def test_bf16_hook_that_keeps_state_fails_in_training(sandbox):
    with pytest.raises(checks.CheckFailed, match=r"(?s)at step 3 of 3, the averaged gradients of parameter\(s\) .*"
                                                 r"differ.*Hint: step 1 agreed.*carries "
                                                 r"something from one call to the next"):
        judged(sandbox, lab02.check_bf16_hook, hook_reusing_its_first_buffer, world_sizes=(2,))


def test_stubs_say_not_implemented(sandbox):
    def stub(*args):
        raise NotImplementedError

    with pytest.raises(NotImplementedError, match="Exercise 2.1 is not implemented"):
        judged(sandbox, lab02.check_average_gradients, stub, world_sizes=(2,))
    assert checks.outcome("Exercise 2.1") == "failed"
    with pytest.raises(NotImplementedError, match="Exercise 2.3 is not implemented"):
        judged(sandbox, lab02.check_bucketed_ddp, stub, world_sizes=(2,))
    assert not checks.ready("Exercise 2.3")
    with pytest.raises(NotImplementedError, match="Exercise 2.2 is not implemented"):
        judged(sandbox, lab02.check_assign_buckets, stub)  # checked in this process, not on ranks
    assert checks.outcome("Exercise 2.2") == "failed"
    with pytest.raises(NotImplementedError, match="Exercise 2.4 is not implemented"):
        judged(sandbox, lab02.check_accumulation, stub, world_sizes=(2,), micro_batches=(2,))
    with pytest.raises(NotImplementedError, match="Exercise 2.5 is not implemented"):
        judged(sandbox, lab02.check_bf16_hook, stub, world_sizes=(2,))
    assert not checks.ready("Exercise 2.5")
