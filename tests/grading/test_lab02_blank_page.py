"""Lab 02's blank-page DDP check (2.6): pass a student's class and the library's, fail the
stub and these wrong answers with the reason, judged as the gradebook judges."""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import judged, ship_by_value
from course_lib.grading import checks, lab02, references
from course_lib.grading.lab02.references import expected_buckets  # Exercise 2.2's rule

ship_by_value(__name__)


class StudentDDP(nn.Module):
    """A student's whole DDP: gradients divided by K as they go into the flat buffers."""

    def __init__(self, module, bucket_cap_mb=25.0, process_group=None):
        super().__init__()
        self.module, self.group = module, process_group
        self.world = dist.get_world_size(process_group)
        self.broadcast()
        self.params = [p for p in module.parameters() if p.requires_grad]
        plan = self.plan([p.numel() * p.element_size() for p in self.params],
                         int(bucket_cap_mb * 2**20))
        self.buckets = [[self.params[i] for i in indices] for indices in plan]
        self.flats = [torch.zeros(sum(p.numel() for p in b)) for b in self.buckets]
        self.home = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self.missing = [len(b) for b in self.buckets]
        self.works, self.syncing, self.queued = [], True, False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.on_gradient)

    def broadcast(self):
        with torch.no_grad():
            for p in self.module.parameters():
                dist.broadcast(p, group=self.group, group_src=0)

    def plan(self, sizes, cap):
        return expected_buckets(sizes, cap)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def on_gradient(self, param):
        if not self.syncing:
            return
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self.missing[self.home[id(param)]] -= 1
        self.launch_ready()

    def launch_ready(self):
        while len(self.works) < len(self.buckets) and self.missing[len(self.works)] == 0:
            k = len(self.works)
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                              for p in self.buckets[k]])
            torch.div(flat, self.divisor(), out=self.flats[k])
            self.works.append(self.start(self.flats[k]))

    def divisor(self):
        return self.world

    def start(self, flat):
        return dist.all_reduce(flat, group=self.group, async_op=True)

    def wait(self):
        for work in self.works:
            work.wait()

    def finish(self):
        self.missing = [0] * len(self.buckets)  # whatever never came goes out as zeros
        self.launch_ready()
        self.wait()
        for bucket, flat in zip(self.buckets, self.flats):
            for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad = piece.view_as(p).clone()
        self.missing = [len(b) for b in self.buckets]
        self.works, self.queued = [], False


class AfterBackwardDDP(StudentDDP):
    """Launches nothing until every gradient is there: all buckets go from the last hook."""

    def launch_ready(self):
        if self.missing == [0] * len(self.buckets):
            super().launch_ready()


class FinishLaunchesDDP(StudentDDP):
    """Launches every bucket from the callback that runs after backward."""

    def on_gradient(self, param):
        if self.syncing and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)


class UndividedDDP(StudentDDP):
    def divisor(self):
        return 1


class ForwardOrderDDP(StudentDDP):
    def plan(self, sizes, cap):
        top = len(sizes) - 1
        return [[top - i for i in b] for b in expected_buckets(sizes[::-1], cap)]


class UnwaitedDDP(StudentDDP):
    def wait(self):
        pass


class AlwaysSyncingDDP(StudentDDP):
    @contextlib.contextmanager
    def no_sync(self):
        yield


class UnbroadcastDDP(StudentDDP):
    def broadcast(self):
        pass


class BlockingDDP(StudentDDP):
    """All-reduces each bucket in the hook and waits there: backward stands still."""

    def start(self, flat):
        dist.all_reduce(flat, group=self.group)
        return "done"

    def wait(self):
        pass


class WaitsForEveryHookDDP(StudentDDP):
    """Never sends a bucket whose hooks did not all fire: an unused layer stops it."""

    def finish(self):
        self.wait()
        for k, (bucket, flat) in enumerate(zip(self.buckets, self.flats)):
            self.works[k]  # a bucket never launched: IndexError
            for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad = piece.view_as(p).clone()
        self.missing = [len(b) for b in self.buckets]
        self.works, self.queued = [], False


def test_a_context_manager_is_not_mistaken_for_torchs():
    # contextlib's wrapper has one code object for every @contextmanager, torch's
    # DistributedDataParallel.no_sync's included: only what it wraps is compared
    assert references.reference_use("Exercise 2.6", [StudentDDP]) == []


def test_a_students_ddp_passes(sandbox, capsys):
    lab02.check_ddp_from_blank_page(StudentDDP, world_sizes=(3,))
    assert "✓ Exercise 2.6 passed" in capsys.readouterr().out
    assert "passed" in judged(sandbox, lab02.check_ddp_from_blank_page, StudentDDP,
                              world_sizes=(2,), seed=7)


@pytest.mark.parametrize("wrong,fragment", [
    (AfterBackwardDDP, r"none of the 4 all-reduces started before the last gradient hook"),
    (FinishLaunchesDDP, r"\(4 of them only after backward had computed every gradient\)"),
    (UndividedDDP, r"are 2.00x the expected ones"),
    (ForwardOrderDDP, r"(?s)\[247, 380, 380, 152, 7\] elements.*expected 4.*\[159, 361, 380, "
                      r"266\].*in forward order"),
    (UnwaitedDDP, r"4 of the 4 all-reduces your class launched had not been waited for"),
    (AlwaysSyncingDDP, r"8 all-reduce\(s\) were issued during the 2 micro-batches run inside"),
    (UnbroadcastDDP, "this rank's parameters are still its own"),
    (BlockingDDP, r"4 all-reduce\(s\) in the last backward were blocking"),
    (WaitsForEveryHookDDP, r"(?s)a layer that forward never calls.*raised IndexError"),
])
def test_wrong_ddps_fail_with_the_reason(wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab02.check_ddp_from_blank_page, wrong, world_sizes=(2,))


def test_the_stub_fails_and_the_library_passes_unless_guarded(sandbox, capsys):
    from torch.nn.parallel import DistributedDataParallel

    from course_lib.ddp import DDP

    class Stub(nn.Module):
        def __init__(self, module, bucket_cap_mb=25.0, process_group=None):
            raise NotImplementedError("Exercise 2.6: DDP from a blank page")

    class WrapsTorch(nn.Module):
        def __init__(self, module, bucket_cap_mb=25.0, process_group=None):
            super().__init__()
            self.ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)

    with pytest.raises(NotImplementedError, match="Exercise 2.6 is not implemented"):
        judged(sandbox, lab02.check_ddp_from_blank_page, Stub, world_sizes=(2,))
    lab02.check_ddp_from_blank_page(DDP, world_sizes=(2,))  # the hidden tests, passed
    assert "✓ Exercise 2.6 passed" in capsys.readouterr().out
    checks.guard_references(True)
    try:
        with pytest.raises(checks.CheckFailed, match="course_lib.ddp.bucketed.DDP"):
            lab02.check_ddp_from_blank_page(DDP)
        with pytest.raises(checks.CheckFailed, match="DistributedDataParallel"):
            lab02.check_ddp_from_blank_page(WrapsTorch)
    finally:
        checks.guard_references(None)
