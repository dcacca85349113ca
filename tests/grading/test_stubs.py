"""Recognising untouched stubs from their bytecode (no processes)."""
import torch

from course_lib.fsdp.unit import GatherShards
from course_lib.grading.stubs import is_stub


def stub(tensor, op=None):
    raise NotImplementedError("Exercise 1.1: naive all-reduce")


def bare_stub():
    raise NotImplementedError


def scaffold_then_stub(tensor, op=None):
    rank = tensor.numel()
    raise NotImplementedError('Exercise 1.1: naive all-reduce')


def started(tensor):
    total = tensor.sum()
    raise NotImplementedError(f"not finished: {total}")


def unsupported(x):
    if x < 0:
        raise NotImplementedError("negative sizes")
    return x


def outer_with_stubbed_inner(full, regather):
    storage = full

    def pack(tensor):
        raise NotImplementedError("Exercise 3.7: free between passes")

    def unpack(saved):
        return saved

    return pack, unpack, storage


class StubbedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group):
        raise NotImplementedError("Exercise 3.6: gather")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Solved:
    def step(self):
        return 1


def test_stubs_are_recognised_in_functions_nested_functions_and_methods():
    assert is_stub(stub) and is_stub(bare_stub)
    assert is_stub(scaffold_then_stub)  # labgen keeps the lines above the solution region
    assert is_stub(outer_with_stubbed_inner)
    assert is_stub(StubbedFunction)


def test_started_or_solved_code_is_not_a_stub():
    assert not is_stub(started)  # the student wrote something first: run it
    assert not is_stub(unsupported)
    assert not is_stub(Solved) and not is_stub(lambda x: x)
    assert not is_stub(3) and not is_stub("text") and not is_stub(None)


def test_course_lib_is_never_a_stub():
    assert not is_stub(GatherShards)


def test_a_job_closing_over_a_stub_is_a_stub():
    def wrap(fn):  # as a check wraps the student's function in a job
        def job():
            return fn(None)
        return job

    assert is_stub(wrap(stub)) and is_stub(wrap(StubbedFunction))
    assert is_stub(wrap(wrap(stub)))  # two levels of closures
    assert not is_stub(wrap(started))
