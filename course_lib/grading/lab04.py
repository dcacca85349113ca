"""Checks of Lab 04's exercises: pipeline schedules, a stage's work, and the partitioner.

4.1 and 4.2 are schedules as data, checked in the notebook's process for many
(p, m), m < p and m = 1 included: :func:`~course_lib.pipeline.validate`, then
the properties (bubble (p-1)/(m+p-1) when simulated, activations in flight per
stage), naming the first action that differs from the reference and the likely
mistake. 4.3 is one microbatch's forward and backward on a stage, run by the
library's executor under real torchrun at 2 and 3 stages against one process
training the whole model on the whole batch. 4.4 is the partitioner, against
brute force on random costs.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.grading import checks
from course_lib.pipeline import (PipelineStage, bubble_fraction, gpipe, mlp_stage, one_f_one_b,
                                 partition_brute_force, peak_in_flight, pipeline_step, simulate,
                                 uneven_mlp, validate)
from course_lib.pipeline.partition import bottleneck, check_ranges, stage_costs

SIZES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 5, 8, 11)]


def _first_difference(got, want):
    """"stage s, position i: expected X, got Y" for the first action that differs."""
    for s, (row_got, row_want) in enumerate(zip(got, want)):
        for i in range(max(len(row_got), len(row_want))):
            a = row_got[i] if i < len(row_got) else None
            b = row_want[i] if i < len(row_want) else None
            if a is None or b is None or tuple(a)[:2] != tuple(b)[:2]:
                shown = "nothing" if a is None else f"{tuple(a)[0]}{tuple(a)[1]}"
                wanted = "nothing" if b is None else f"{b[0]}{b[1]}"
                return (f"first difference from the reference: stage {s}, position {i}: "
                        f"expected {wanted}, got {shown}\n  reference stage {s}: {row_want}\n"
                        f"  yours     stage {s}: {list(row_got)}")
    return None


def _call(fn, p, m, ex):
    try:
        got = fn(p, m)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the student's error, reported as the check's
        raise checks.CheckFailed(f"{ex}: your function raised for p={p}, m={m}: "
                                 f"{type(exc).__name__}: {exc}") from None
    if not isinstance(got, (list, tuple)):
        raise checks.CheckFailed(f"{ex}: for p={p}, m={m} your function returned "
                                 f"{type(got).__name__}; a schedule is a list (one per stage) of "
                                 f"lists of Action(kind, microbatch)")
    return [list(row) if isinstance(row, (list, tuple)) else row for row in got]


def _validated(ex, got, want, p, m, hint):
    try:
        validate(got, p, m)
    except ValueError as exc:
        diff = _first_difference(got, want) if all(isinstance(r, list) for r in got) else None
        raise checks.CheckFailed(f"{ex}: for p={p}, m={m} the schedule is not valid: {exc}"
                                 + (f"\n{diff}" if diff else "") + f"\nHint: {hint}") from None


def _forwards_before_first_backward(row):
    count = 0
    for a in row:
        if tuple(a)[0] == "B":
            return count
        count += 1
    return count


def _expect_bubble(ex, got, want, p, m, why="", hint=""):
    """CheckFailed unless the simulated bubble of ``got`` is (p-1)/(m+p-1)."""
    bubble = simulate(got).bubble
    if abs(bubble - bubble_fraction(p, m)) > 1e-9:
        raise checks.CheckFailed(
            f"{ex}: for p={p}, m={m} the simulated bubble is {bubble:.4f}, expected "
            f"(p-1)/(m+p-1) = {bubble_fraction(p, m):.4f}{why}.\n"
            f"{_first_difference(got, want)}{hint}")


def check_gpipe(gpipe_schedule):
    ex = "Exercise 4.1"
    with checks.in_process(ex, gpipe_schedule):
        for p, m in SIZES:
            got = _call(gpipe_schedule, p, m, ex)
            want = gpipe(p, m)
            _validated(ex, got, want, p, m, "every stage runs F0, F1, ..., F(m-1), then the "
                                            "backwards; one list of Actions per stage")
            peaks = peak_in_flight(got)
            if peaks != [m] * p:
                s = next(i for i, k in enumerate(peaks) if k != m)
                raise checks.CheckFailed(
                    f"{ex}: for p={p}, m={m} stage {s} holds at most {peaks[s]} microbatches, "
                    f"but GPipe holds all m={m}: every forward runs before any backward.\n"
                    f"{_first_difference(got, want)}\nHint: that is the 1F1B order (next "
                    f"exercise); GPipe flushes all m forwards through first")
            _expect_bubble(ex, got, want, p, m)
    checks.passed(ex, f"{len(SIZES)} (p, m), m < p and m = 1 included: valid, bubble "
                      f"(p-1)/(m+p-1), m microbatches in flight")


def check_one_f_one_b(one_f_one_b_schedule):
    ex = "Exercise 4.2"
    with checks.in_process(ex, one_f_one_b_schedule):
        for p, m in SIZES:
            got = _call(one_f_one_b_schedule, p, m, ex)
            want = one_f_one_b(p, m)
            _validated(ex, got, want, p, m, _warmup_hint(got, p, m))
            peaks, limits = peak_in_flight(got), [min(m, p - s) for s in range(p)]
            if peaks != limits:
                s = next(i for i, (a, b) in enumerate(zip(peaks, limits)) if a != b)
                raise checks.CheckFailed(
                    f"{ex}: for p={p}, m={m} stage {s} holds up to {peaks[s]} microbatches' "
                    f"activations; 1F1B holds min(m, p-s) = {limits[s]} there (all stages: "
                    f"{limits}, yours: {peaks}).\n{_first_difference(got, want)}\n"
                    f"Hint: {_warmup_hint(got, p, m)}")
            _expect_bubble(ex, got, want, p, m, why=": some stage waits where 1F1B would not",
                           hint="\nHint: after the warm-up, alternate one forward and one "
                                "backward, the forward first")
    checks.passed(ex, f"{len(SIZES)} (p, m): valid, bubble (p-1)/(m+p-1), min(m, p-s) "
                      f"microbatches in flight on stage s")


def _warmup_hint(got, p, m):
    """What the warm-up should be, said against what the student's stages do."""
    for s, row in enumerate(got):
        if not isinstance(row, list):
            break
        have, want = _forwards_before_first_backward(row), min(p - s, m)
        if have != want:
            return (f"stage {s} runs {have} forward(s) before its first backward; 1F1B runs "
                    f"min(m, p-s) = {want}: a warm-up of min(m, p-s-1) = {min(m, p - s - 1)} "
                    f"forwards, then the steady phase's first forward. The first stage warms up "
                    f"the most, the last not at all, and the warm-up never exceeds m")
    return ("warm up with min(m, p-s-1) forwards, then alternate F and B, then run the "
            "backwards left (cool-down)")


# ---- 4.3: one microbatch's forward and backward ------------------------------------------------
MLP_SIZES = [13, 40, 7, 29, 11, 5]
LR, STEPS = 0.1, 2


def _stage_layers(p):
    from course_lib.pipeline import partition

    return partition([1] * (2 * len(MLP_SIZES) - 3), p)


def _data(rows):
    gen = torch.Generator().manual_seed(4)
    return (torch.randn(rows, MLP_SIZES[0], generator=gen),
            torch.randn(rows, MLP_SIZES[-1], generator=gen))


def _student_job(forward_step, backward_step, cases):
    s, p = dist.get_rank(), dist.get_world_size()
    out = []
    for schedule_name, m, rows in cases:
        module = mlp_stage(MLP_SIZES, _stage_layers(p)[s])
        stage = PipelineStage(module, s, p)
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        schedule = (gpipe if schedule_name == "gpipe" else one_f_one_b)(p, m)
        x, y = _data(rows)
        first_grads, losses = None, []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = pipeline_step(stage, schedule, batch=x if s == 0 else None,
                                 targets=y if s == p - 1 else None, loss_fn=F.mse_loss,
                                 forward_step=forward_step, backward_step=backward_step)
            if first_grads is None:
                first_grads = {n: q.grad.clone() for n, q in module.named_parameters()
                               if q.grad is not None}
            opt.step()
            losses.append(None if loss is None else float(loss))
        out.append({"grads": first_grads, "state": module.state_dict(), "losses": losses,
                    "peak": stage.peak_in_flight, "expected_peak": peak_in_flight(schedule)[s]})
    return out


def _reference(rows):
    model = uneven_mlp(MLP_SIZES)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data(rows)
    first_grads, losses = None, []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if first_grads is None:
            first_grads = {n: q.grad.clone() for n, q in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return first_grads, model.state_dict(), losses


def _grad_hint(got, want, m):
    ratio = float((got * want).sum() / (want * want).sum().clamp_min(1e-30))
    if m > 1 and abs(ratio - m) < 0.05 * m:
        return (f"the gradient is {ratio:.2f} times the full batch's, about m={m}: scale each "
                f"microbatch's loss by its weight (1/m for an even split) before backward")
    if m > 1 and abs(ratio - 1 / m) < 0.05 / m:
        return (f"the gradient is 1/{1 / ratio:.2f} of the full batch's: the weight is applied "
                f"twice, or the gradient is scaled again on its way back")
    return ("on the last stage the loss is loss_fn(y, target) * weight; elsewhere backward "
            "needs y.backward(grad) with the gradient received for this microbatch, and the "
            "gradient to send back is the received activation's .grad")


def check_stage_steps(forward_step, backward_step, world_sizes=(2, 3)):
    ex = "Exercise 4.3"
    for p in world_sizes:
        # 12 rows split evenly first (a factor m shows as m), then 11 rows: uneven microbatches
        cases = [("gpipe", p, 12), ("1f1b", p, 12), ("1f1b", 2 * p + 1, 11), ("gpipe", 1, 11)]
        outs = checks.launch(ex, _student_job, forward_step, backward_step, cases, nproc=p,
                             timeout=90)
        for c, (schedule_name, m, rows) in enumerate(cases):
            ref_grads, ref_state, ref_losses = _reference(rows)
            what = f"{schedule_name}, m={m}, a batch of {rows} rows"
            for s in range(p):
                got = outs[s][c]
                for name, want in ref_grads.items():
                    if name not in got["state"]:
                        continue
                    if name not in got["grads"]:
                        raise checks.CheckFailed(
                            f"{ex}: stage {s} of {p} ({what}): parameter {name} got no gradient."
                            f"\nHint: the backward must run through this stage's module: "
                            f"y.backward(grad) with the output stashed by the forward")
                    checks.expect_close(ex, got["grads"][name], want, rank=s, world_size=p,
                                        rtol=1e-5, atol=1e-6,
                                        what=f"gradient of {name} after the first step ({what}) "
                                             f"vs one process on the whole batch",
                                        hint=_grad_hint(got["grads"][name], want, m))
                for name, tensor in got["state"].items():
                    checks.expect_close(ex, tensor, ref_state[name], rank=s, world_size=p,
                                        rtol=1e-5, atol=1e-6,
                                        what=f"{name} after {STEPS} SGD steps ({what})")
                checks.expect_equal(
                    ex, got["peak"], got["expected_peak"], rank=s, world_size=p,
                    what=f"most microbatches in stage.stash at once ({what})",
                    hint="the forward keeps what the backward needs in stage.stash[microbatch]; "
                         "the backward takes it out (pop), which frees the activations")
            last = outs[p - 1][c]["losses"]
            if any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(last, ref_losses)):
                raise checks.CheckFailed(
                    f"{ex}: the last stage's losses ({what}) are {last}, one process on the "
                    f"whole batch gets {ref_losses}.\nHint: return the weighted loss from the "
                    f"last stage's forward; the executor adds them up to the batch's mean loss")
    checks.passed(ex, f"{len(world_sizes)} pipeline depths {list(world_sizes)}, GPipe and 1F1B, "
                      f"uneven microbatches: gradients, weights and losses as one process, "
                      f"activations freed as the schedule allows")


# ---- 4.4: the partitioner ---------------------------------------------------------------
def check_partition(partition, trials=300):
    ex = "Exercise 4.4"
    with checks.in_process(ex, partition):
        rng = random.Random(5)
        cases = [([4, 1, 1, 1, 1, 4], 3), ([1, 1, 1, 9], 2), ([3], 1), ([2, 2, 2, 2], 4),
                 ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3), ([10, 1, 1, 1, 1, 1, 1, 10], 2)]
        for _ in range(trials):
            n = rng.randint(1, 10)
            cases.append(([rng.randint(0, 20) for _ in range(n)], rng.randint(1, n)))
        for costs, p in cases:
            try:
                got = list(partition(list(costs), p))
            except NotImplementedError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise checks.CheckFailed(f"{ex}: partition({costs}, p={p}) raised "
                                         f"{type(exc).__name__}: {exc}") from None
            try:
                check_ranges(got, len(costs), p)
            except ValueError as exc:
                raise checks.CheckFailed(
                    f"{ex}: partition({costs}, p={p}) returned {got}: {exc}.\nHint: return p "
                    f"range(start, end) objects, in order, together covering every layer "
                    f"once") from None
            best = partition_brute_force(costs, p)
            if bottleneck(costs, got) > bottleneck(costs, best) + 1e-9:
                raise checks.CheckFailed(
                    f"{ex}: partition({costs}, p={p}) = {got}: stage costs "
                    f"{stage_costs(costs, got)}, slowest {bottleneck(costs, got)}; a better cut "
                    f"is {best} (stage costs {stage_costs(costs, best)}, slowest "
                    f"{bottleneck(costs, best)}).\nHint: a greedy cut (fill a stage up to the "
                    f"average, then move on) can be beaten; best(k, j) = min over i of "
                    f"max(best(k-1, i), cost of layers i..j-1) tries every last cut")
    checks.passed(ex, f"{len(cases)} cost lists against brute force")
