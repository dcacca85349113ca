"""Checks of Lab 03's mixed-precision section: fp32 master weights for a bf16 model
(Exercise 3.9), a dynamic loss scaler for fp16 written from a blank page (Exercise 3.10),
and the model state of each recipe (Prediction 3.2, :mod:`.predictions`).

Both exercises run in the student's process (:mod:`.jobs`, plain facts back); the
checks compare with references computed here: the library's
:class:`~course_lib.memory.precision.FP32Master` on the same runs, and torch's own
``torch.amp.GradScaler`` on the same overflowing fp16 runs. A wrong answer is matched
with the trajectory of a known mistake to say which one it is.
"""
from __future__ import annotations

import torch

from course_lib.grading import checks, salt
from course_lib.grading.lab03_mixed.jobs import (MASTER_CASES, SCALER_SETTINGS, SCALER_STEPS,
                                                 master_facts, master_model, scaler_facts,
                                                 train_with_master)
from course_lib.grading.lab03_mixed.predictions import check_state_prediction  # noqa: F401
from course_lib.grading.requests import here
from course_lib.memory.loss_scaling import fp16_run, grad_scaler
from course_lib.memory.precision import FP32Master, state_bytes_per_param


class _RebuiltMaster(FP32Master):
    """A known mistake: masters copied from the bf16 weights before each step."""

    def step(self):
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                master.copy_(param)
        super().step()


def _masters_of(made):
    return [p.detach() for g in made[0].param_groups for p in g["params"]]


def _same(got, want, rtol=1e-5, atol=1e-7):
    return len(got) == len(want) and all(
        g.shape == w.shape and torch.allclose(g.float(), w.float(), rtol=rtol, atol=atol)
        for g, w in zip(got, want))


def _judge_masters(ex, where, got, seed, lr, steps):
    ref_made, ref_model, _ = train_with_master(FP32Master, seed, lr, steps)
    want = _masters_of(ref_made)
    if _same(got["masters"], want):
        return
    initial = [p.detach().float() for p in master_model(seed).parameters()]
    rebuilt = _masters_of(train_with_master(_RebuiltMaster, seed, lr, steps)[0])
    moved = not _same([p.detach().float() for p in ref_model.parameters()], initial, 0, 0)
    if moved and _same(got["params"], initial, rtol=0, atol=0):
        why = ("the bf16 parameters never changed, so every step saw the first step's "
               "weights: after optimizer.step(), copy each master into its parameter (in "
               "torch.no_grad(): param.copy_(master))")
    elif _same(got["masters"], initial, rtol=0, atol=0):
        why = ("the masters never moved: before optimizer.step(), give each master its "
               "parameter's gradient in fp32 (master.grad = param.grad.float())")
    elif _same(got["masters"], rebuilt):
        why = ("your masters are copied from the bf16 weights each step, so every update "
               "smaller than half a bf16 step of its weight (2^-9 to 2^-8 of it) is lost: keep the "
               "masters from one step to the next, and copy only master -> bf16")
    else:
        gap = max(((g.float() - w).abs().max().item() for g, w in zip(got["masters"], want)
                   if g.shape == w.shape), default=float("nan"))
        why = (f"they differ from AdamW stepping fp32 copies on the fp32 gradients (largest "
               f"difference {gap:.3g}); one master per parameter, in the parameters' order")
    raise checks.CheckFailed(f"{ex}: {where}, the masters the optimizer stepped are wrong.\n"
                             f"Hint: {why}")


@checks.check("Exercise 3.9", hidden=salt.draw)
def check_master_weights(master_cls):
    ex = "Exercise 3.9"
    facts = yield here(master_facts, master_cls)
    for (seed, lr, steps), got in zip(MASTER_CASES, facts):
        where = f"training a bf16 MLP for {steps} AdamW steps at lr = {lr:g}"
        if got["optimizers"] != 1:
            raise checks.CheckFailed(
                f"{ex}: {where}, make_optimizer was called {got['optimizers']} times.\nHint: "
                f"call it once, in __init__, with the fp32 masters: AdamW's moments must "
                f"live from one step to the next.")
        if got["master_dtypes"] != ["torch.float32"]:
            raise checks.CheckFailed(
                f"{ex}: {where}, the optimizer steps tensors of dtype "
                f"{', '.join(got['master_dtypes']) or '(none)'}.\nHint: give make_optimizer "
                f"fp32 copies of the parameters (the masters), not the bf16 parameters.")
        _judge_masters(ex, where, got, seed, lr, steps)
        rounded = [m.to(torch.bfloat16).float() for m in got["masters"]]
        if not _same(got["params"], rounded, rtol=0, atol=0):
            raise checks.CheckFailed(
                f"{ex}: {where}, the bf16 parameters are not the masters rounded to bf16.\n"
                f"Hint: after optimizer.step(), copy each master into its parameter "
                f"(in torch.no_grad(): param.copy_(master)).")
        held, numel = got["bytes"], got["numel"]
        if held["master_grads"]:
            raise checks.CheckFailed(
                f"{ex}: {where}, the masters still hold fp32 gradients after the step "
                f"({held['master_grads'] / numel:g} bytes a parameter).\nHint: set each "
                f"master's .grad to None once the optimizer has stepped: the recipe's "
                f"16 bytes have no room for them.")
        per_param = (held["total"] + held["master"]) / numel
        if per_param != state_bytes_per_param("bf16_master"):
            parts = ", ".join(f"{k} {held[k] / numel:g}" for k in ("params", "grads",
                                                                   "optimizer", "master"))
            raise checks.CheckFailed(
                f"{ex}: {where}, the model state is {per_param:g} bytes a parameter "
                f"({parts}), not 2 + 2 + 8 + 4 = 16.")
    return (f"{len(MASTER_CASES)} runs: masters as AdamW on fp32 copies, bf16 weights "
            f"their rounding, 16 bytes a parameter")


def _settings_text(settings):
    return ", ".join(f"{k}={v:g}" for k, v in settings.items())


def _scale_step(ex, where, i, got, want, before, settings):
    """CheckFailed at step ``i`` where the student's run leaves GradScaler's."""
    if i and abs(got["losses"][i] - want["losses"][i]) > 1e-6 * abs(want["losses"][i]):
        raise checks.CheckFailed(
            f"{ex}: {where}, the loss of step {i} is {got['losses'][i]:.6g}, not "
            f"{want['losses'][i]:.6g}: the weights step {i - 1} left are wrong, though its "
            f"scale and its skip were right.\nHint: the optimizer must see the true "
            f"gradients: divide each by the scale, once, before optimizer.step().")
    if got["multiplied"][i] != want["multiplied"][i]:
        raise checks.CheckFailed(
            f"{ex}: {where}, at step {i} scale(loss) multiplied the loss by "
            f"{got['multiplied'][i]:g}; the scale was {before:g}.\nHint: return loss times "
            f"the current scale.")
    if got["stepped"][i] != want["stepped"][i]:
        if want["stepped"][i]:
            why = (f"its gradients were all finite (scale {before:g}) yet the weights did not "
                   f"change: unscale them and call optimizer.step()")
        else:
            why = (f"its gradients held an inf or a nan (scale {before:g} overflowed fp16), "
                   f"yet you took the step: skip optimizer.step() when any gradient is "
                   f"not finite")
        raise checks.CheckFailed(f"{ex}: {where}, step {i}: {why}.")
    have, should = got["scales"][i], want["scales"][i]
    if have == should:
        return
    if not want["stepped"][i]:
        why = (f"after an overflow the scale backs off: {before:g} x "
               f"{settings.get('backoff_factor', 0.5):g} = {should:g}, and the count of clean "
               f"steps starts again")
    elif should > before:
        why = (f"this step made growth_interval = {settings['growth_interval']} clean steps in "
               f"a row: the scale grows by {settings.get('growth_factor', 2.0):g} to "
               f"{should:g}")
    else:
        why = (f"a clean step, but fewer than growth_interval = {settings['growth_interval']} "
               f"in a row since the last overflow or growth: the scale stays {should:g} "
               f"(count the clean steps since the scale last changed)")
    raise checks.CheckFailed(f"{ex}: {where}, after step {i} your scale is {have:g}.\n"
                             f"Hint: {why}.")


@checks.check("Exercise 3.10", hidden=salt.draw)
def check_loss_scaler(scaler_cls):
    ex = "Exercise 3.10"
    facts = yield here(scaler_facts, scaler_cls)
    for settings, got in zip(SCALER_SETTINGS, facts):
        want = fp16_run(grad_scaler(**settings), steps=SCALER_STEPS)
        where = f"fp16 training with DynamicLossScaler({_settings_text(settings)})"
        for i in range(SCALER_STEPS):
            before = settings["init_scale"] if i == 0 else want["scales"][i - 1]
            _scale_step(ex, where, i, got, want, before, settings)
        if not _same(got["params"], want["params"]):
            raise checks.CheckFailed(
                f"{ex}: {where}: the same scales and skipped steps as torch's GradScaler, but "
                f"different weights after {SCALER_STEPS} steps.\nHint: the optimizer must "
                f"see the true gradients: divide each by the scale, once, before "
                f"optimizer.step().")
    skipped = sum(not s for got in facts for s in got["stepped"])
    return (f"{len(SCALER_SETTINGS)} fp16 runs of {SCALER_STEPS} steps ({skipped} overflows "
            f"skipped): scales, skips and weights as torch.amp.GradScaler")
