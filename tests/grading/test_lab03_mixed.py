"""Lab 03's mixed-precision checks (3.9, 3.10): pass the references, fail the stubs and
these wrong answers with the reason, judged as the gradebook judges."""
import pytest
import torch

from conftest import judged, ship_by_value
from course_lib.grading import checks, lab03_mixed

ship_by_value(__name__)


class Master:
    """A student's fp32 master weights."""

    def __init__(self, params, make_optimizer):
        self.params = list(params)
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        self.optimizer = make_optimizer(self.masters)

    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
                m.grad = None

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class MasterKeepingGrads(Master):
    def step(self):
        super().step()
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()


class MasterNotCopiedBack(Master):
    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
        self.optimizer.step()
        for m in self.masters:
            m.grad = None


class MasterRebuiltEachStep(Master):
    def step(self):
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                m.copy_(p)
        super().step()


class NoMaster(Master):
    def __init__(self, params, make_optimizer):
        self.params = list(params)
        self.optimizer = make_optimizer(self.params)

    def step(self):
        self.optimizer.step()


class Scaler:
    """A student's dynamic loss scaler."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
        self.s, self.up, self.down, self.every = init_scale, growth_factor, backoff_factor, \
            growth_interval
        self.clean, self.bad = 0, False

    def scale(self, loss):
        return loss * self.s

    def grads(self, optimizer):
        return [p.grad for g in optimizer.param_groups for p in g["params"]
                if p.grad is not None]

    def step(self, optimizer):
        for g in self.grads(optimizer):
            g.div_(self.s)
        self.bad = any(not torch.isfinite(g).all() for g in self.grads(optimizer))
        if not self.bad:
            optimizer.step()

    def update(self):
        if self.bad:
            self.s, self.clean = self.s * self.down, 0
        else:
            self.clean += 1
            if self.clean == self.every:
                self.s, self.clean = self.s * self.up, 0

    def get_scale(self):
        return self.s


class ScalerStepsOnOverflow(Scaler):
    def step(self, optimizer):
        super().step(optimizer)
        if self.bad:
            optimizer.step()


class ScalerNeverResets(Scaler):
    def update(self):
        if self.bad:
            self.s *= self.down
        else:
            self.clean += 1
            if self.clean % self.every == 0:
                self.s *= self.up


class ScalerWithoutUnscaling(Scaler):
    def step(self, optimizer):
        self.bad = any(not torch.isfinite(g).all() for g in self.grads(optimizer))
        if not self.bad:
            optimizer.step()


class ScalerNeverBacksOff(Scaler):
    def update(self):
        self.bad = False
        super().update()


class ScalerThatDoesNotScale(Scaler):
    def scale(self, loss):
        return loss


def test_the_references_pass(sandbox):
    assert "16 bytes a parameter" in judged(sandbox, lab03_mixed.check_master_weights, Master, seed=7)
    assert "as torch.amp.GradScaler" in judged(sandbox, lab03_mixed.check_loss_scaler, Scaler, seed=7)


@pytest.mark.parametrize("wrong,fragment", [
    (MasterKeepingGrads, "still hold fp32 gradients"),
    (MasterNotCopiedBack, "the bf16 parameters never changed"),
    (MasterRebuiltEachStep, "copied from the bf16 weights each step"),
    (NoMaster, "dtype torch.bfloat16"),
])
def test_wrong_master_weights_are_named(wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab03_mixed.check_master_weights, wrong)


@pytest.mark.parametrize("wrong,fragment", [
    (ScalerStepsOnOverflow, "yet you took the step"),
    (ScalerNeverResets, "since the last overflow or growth"),
    (ScalerWithoutUnscaling, "divide each by the scale"),
    (ScalerNeverBacksOff, "backs off"),
    (ScalerThatDoesNotScale, "multiplied the loss by 1"),
])
def test_wrong_loss_scalers_are_named(wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab03_mixed.check_loss_scaler, wrong)


def test_stubs_say_not_implemented():
    class StubScaler:
        def scale(self, loss):
            raise NotImplementedError("Exercise 3.10: a dynamic loss scaler")

    class StubMaster:
        def __init__(self, params, make_optimizer):
            raise NotImplementedError("Exercise 3.9: fp32 master weights")

    with pytest.raises(NotImplementedError, match="Exercise 3.10 is not implemented"):
        lab03_mixed.check_loss_scaler(StubScaler)
    with pytest.raises(NotImplementedError, match="Exercise 3.9 is not implemented"):
        lab03_mixed.check_master_weights(StubMaster)
