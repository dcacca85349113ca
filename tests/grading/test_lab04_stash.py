"""Lab 04's weight-stash check (4.5): pass a student's stash, fail the stub and these wrong
answers with the reason, judged as the gradebook judges."""
from contextlib import contextmanager

import pytest
import torch

from conftest import judged, ship_by_value
from course_lib.grading import checks, lab04
from course_lib.pipeline import NoStash  # save, restore and drop do nothing

ship_by_value(__name__)


class Stash:
    """A student's weight stash: copies by microbatch, swapped in around the backward."""

    def __init__(self):
        self.saved = {}

    def save(self, microbatch, module):
        self.saved[microbatch] = [p.detach().clone() for p in module.parameters()]

    @contextmanager
    def restore(self, microbatch, module):
        now = [p.detach().clone() for p in module.parameters()]
        self.load(module, self.saved[microbatch])
        yield
        self.load(module, now)

    @staticmethod
    def load(module, tensors):
        with torch.no_grad():
            for p, t in zip(module.parameters(), tensors):
                p.copy_(t)

    def drop(self, microbatch):
        del self.saved[microbatch]


class ReferencesStashed(Stash):
    """detach() without clone(): the optimizer's in-place step changes the 'stash'."""

    def save(self, microbatch, module):
        self.saved[microbatch] = [p.detach() for p in module.parameters()]


class NeverDropped(Stash):
    def drop(self, microbatch):
        pass


class LatestRestored(Stash):
    """A stack: restores the version saved last, whichever microbatch it belongs to."""

    def __init__(self):
        self.saved = []

    def save(self, microbatch, module):
        self.saved.append([p.detach().clone() for p in module.parameters()])

    @contextmanager
    def restore(self, microbatch, module):
        now = [p.detach().clone() for p in module.parameters()]
        self.load(module, self.saved[-1])
        yield
        self.load(module, now)

    def drop(self, microbatch):
        self.saved.pop(0)  # backwards come in forward order: the oldest is done


class LeftRestored(Stash):
    """Puts the stashed version in, never the current one back."""

    @contextmanager
    def restore(self, microbatch, module):
        self.load(module, self.saved[microbatch])
        yield


def test_a_students_stash_passes(sandbox, capsys):
    lab04.check_weight_stash(Stash, world_sizes=(3,))
    assert "✓ Exercise 4.5 passed" in capsys.readouterr().out
    assert "passed" in judged(sandbox, lab04.check_weight_stash, Stash, world_sizes=(2,), seed=7)


@pytest.mark.parametrize("wrong,fragment,depth", [
    (NoStash, r"ran on version 1, the current weights, but its forward ran on version 0"
                     r"(.|\n)*held no tensors", 2),
    (ReferencesStashed, "holds the parameters themselves", 2),
    (NeverDropped, r"drop\(microbatch\) must delete", 2),
    (LatestRestored, r"the one microbatch 4's forward used; its own forward used version 1", 3),
    (LeftRestored, "did not hold the current weights", 2),
])
def test_wrong_stashes_fail_with_the_reason(wrong, fragment, depth, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab04.check_weight_stash, wrong, world_sizes=(depth,))


def test_the_stub_fails_and_the_library_passes_unless_guarded(sandbox, capsys):
    from course_lib.pipeline import WeightStash

    class WeightStashStub:
        def __init__(self):
            raise NotImplementedError("Exercise 4.5: weight stashing")

        def save(self, microbatch, module):
            raise NotImplementedError("Exercise 4.5: weight stashing")

    with pytest.raises(NotImplementedError, match="Exercise 4.5 is not implemented"):
        judged(sandbox, lab04.check_weight_stash, WeightStashStub, world_sizes=(2,))
    lab04.check_weight_stash(WeightStash, world_sizes=(2,))  # the hidden tests, passed
    assert "✓ Exercise 4.5 passed" in capsys.readouterr().out
    checks.guard_references(True)
    try:
        with pytest.raises(checks.CheckFailed, match="course_lib.pipeline.async_1f1b.WeightStash"):
            lab04.check_weight_stash(WeightStash)
    finally:
        checks.guard_references(None)
