"""Checks of Lab 04's exercises: pipeline schedules, a stage's work, and the partitioner.

4.1 and 4.2 are schedules as data: the student's function is called in its own
process for many (p, m), m < p and m = 1 included, and the schedules come back
as data (:mod:`.jobs`); here :func:`~course_lib.pipeline.validate` judges them,
then the properties (bubble (p-1)/(m+p-1) when simulated, activations in flight
per stage), naming the first action that differs from the reference and the
likely mistake. 4.3 is one microbatch's forward and backward on a stage, run by
the library's executor under real torchrun at 2 and 3 stages against one process
training the whole model on the whole batch (here). 4.4 is the partitioner,
against brute force on random costs. Predictions 4.1 and 4.2:
:mod:`~course_lib.grading.lab04.predictions`; 4.5, the weight stash of PipeDream's
asynchronous 1F1B: :mod:`~course_lib.grading.lab04.stashing`.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from course_lib.grading import checks, salt
from course_lib.grading.lab04.jobs import (LR, MLP_SIZES, STEPS, data, partitions, rebuilt,
                                           schedules, stage_job)
from course_lib.grading.lab04.predictions import (check_bubble_prediction,  # noqa: F401
                                                  check_in_flight_prediction)
from course_lib.grading.lab04.stashing import check_weight_stash  # noqa: F401
from course_lib.grading.requests import here, on_ranks
from course_lib.pipeline import (bubble_fraction, gpipe, one_f_one_b, partition_brute_force,
                                 peak_in_flight, simulate, uneven_mlp, validate)
from course_lib.pipeline.partition import bottleneck, check_ranges, stage_costs

SIZES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 5, 8, 11)]


def _drawn_sizes(rng):
    """The gradebook's hidden (p, m): deeper pipelines and more microbatches than shown."""
    return tuple((rng.randint(6, 9), rng.randint(1, 16)) for _ in range(3))


# ---- 4.1 and 4.2: schedules ---------------------------------------------------------------------
def _schedule(ex, answer, p, m):
    """The schedule the student's function returned for (p, m), rows as lists."""
    if "raised" in answer:
        raise checks.CheckFailed(f"{ex}: your function raised for p={p}, m={m}: "
                                 f"{answer['raised']}: {answer['message']}")
    got = answer["value"]
    if isinstance(got, tuple):
        raise checks.CheckFailed(f"{ex}: for p={p}, m={m} your function returned "
                                 f"{type(rebuilt(got)).__name__}; a schedule is a list (one per "
                                 f"stage) of lists of Action(kind, microbatch)")
    return [[rebuilt(a) for a in row] if isinstance(row, list) else rebuilt(row) for row in got]


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


def _validated(ex, got, want, p, m, hint):
    try:
        validate(got, p, m)
    except ValueError as exc:
        diff = _first_difference(got, want) if all(isinstance(r, list) for r in got) else None
        raise checks.CheckFailed(f"{ex}: for p={p}, m={m} the schedule is not valid: {exc}"
                                 + (f"\n{diff}" if diff else "") + f"\nHint: {hint}") from None


def _expect_bubble(ex, got, want, p, m, why="", hint=""):
    """CheckFailed unless the simulated bubble of ``got`` is (p-1)/(m+p-1)."""
    bubble = simulate(got).bubble
    if abs(bubble - bubble_fraction(p, m)) > 1e-9:
        raise checks.CheckFailed(
            f"{ex}: for p={p}, m={m} the simulated bubble is {bubble:.4f}, expected "
            f"(p-1)/(m+p-1) = {bubble_fraction(p, m):.4f}{why}.\n"
            f"{_first_difference(got, want)}{hint}")


@checks.check("Exercise 4.1", hidden=lambda rng: {"sizes": _drawn_sizes(rng)})
def check_gpipe(gpipe_schedule, sizes=tuple(SIZES)):
    ex = "Exercise 4.1"
    answers = yield here(schedules, gpipe_schedule, list(sizes))
    for (p, m), answer in zip(sizes, answers):
        got, want = _schedule(ex, answer, p, m), gpipe(p, m)
        _validated(ex, got, want, p, m, "every stage runs F0, F1, ..., F(m-1), then the "
                                        "backwards; one list of Actions per stage")
        peaks = peak_in_flight(got)
        if peaks != [m] * p:
            s = next(i for i, k in enumerate(peaks) if k != m)
            raise checks.CheckFailed(
                f"{ex}: for p={p}, m={m} stage {s} starts a backward before its last "
                f"forward, but GPipe runs every forward before any backward.\n"
                f"{_first_difference(got, want)}\nHint: that is the 1F1B order (next "
                f"exercise); GPipe flushes all m forwards through first")
        _expect_bubble(ex, got, want, p, m)
    # (how many microbatches a stage holds is Prediction 4.2's question: not told here)
    return (f"{len(sizes)} (p, m), m < p and m = 1 included: valid, bubble (p-1)/(m+p-1), "
            f"every forward before any backward")


@checks.check("Exercise 4.2", hidden=lambda rng: {"sizes": _drawn_sizes(rng)})
def check_one_f_one_b(one_f_one_b_schedule, sizes=tuple(SIZES)):
    ex = "Exercise 4.2"
    answers = yield here(schedules, one_f_one_b_schedule, list(sizes))
    for (p, m), answer in zip(sizes, answers):
        got, want = _schedule(ex, answer, p, m), one_f_one_b(p, m)
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
    return (f"{len(sizes)} (p, m): valid, bubble (p-1)/(m+p-1), min(m, p-s) microbatches "
            f"in flight on stage s")


def _warmup_hint(got, p, m):
    """What the warm-up should be, said against what the student's stages do."""
    for s, row in enumerate(got):
        if not isinstance(row, list):
            break
        have = next((i for i, a in enumerate(row) if tuple(a)[0] == "B"), len(row))
        want = min(p - s, m)
        if have != want:
            return (f"stage {s} runs {have} forward(s) before its first backward; 1F1B runs "
                    f"min(m, p-s) = {want}: a warm-up of min(m, p-s-1) = {min(m, p - s - 1)} "
                    f"forwards, then the steady phase's first forward. The first stage warms up "
                    f"the most, the last not at all, and the warm-up never exceeds m")
    return ("warm up with min(m, p-s-1) forwards, then alternate F and B, then run the "
            "backwards left (cool-down)")


# ---- 4.3: one microbatch's forward and backward ------------------------------------------------
def _reference(rows):
    model = uneven_mlp(MLP_SIZES)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = data(rows)
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


@checks.check("Exercise 4.3", hidden=salt.draw)
def check_stage_steps(forward_step, backward_step, world_sizes=(2, 3)):
    ex = "Exercise 4.3"
    for p in world_sizes:
        # 12 rows split evenly first (a factor m shows as m), then 11 rows: uneven microbatches
        cases = [("gpipe", p, 12), ("1f1b", p, 12), ("1f1b", 2 * p + 1, 11), ("gpipe", 1, 11)]
        outs = yield on_ranks(stage_job, forward_step, backward_step, cases, nproc=p, timeout=90)
        for c, (schedule_name, m, rows) in enumerate(cases):
            ref_grads, ref_state, ref_losses = _reference(rows)
            peaks = peak_in_flight((gpipe if schedule_name == "gpipe" else one_f_one_b)(p, m))
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
                    ex, got["peak"], peaks[s], rank=s, world_size=p,
                    what=f"most microbatches in stage.stash at once ({what})",
                    hint="the forward keeps what the backward needs in stage.stash[microbatch]; "
                         "the backward takes it out (pop), which frees the activations")
            last = outs[p - 1][c]["losses"]
            if any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(last, ref_losses)):
                raise checks.CheckFailed(
                    f"{ex}: the last stage's losses ({what}) are {last}, one process on the "
                    f"whole batch gets {ref_losses}.\nHint: return the weighted loss from the "
                    f"last stage's forward; the executor adds them up to the batch's mean loss")
    return (f"{len(world_sizes)} pipeline depths {list(world_sizes)}, GPipe and 1F1B, uneven "
            f"microbatches: gradients, weights and losses as one process, activations freed "
            f"as the schedule allows")


# ---- 4.4: the partitioner ---------------------------------------------------------------
@checks.check("Exercise 4.4", hidden=checks.reseeded)
def check_partition(partition, trials=300, seed=5):
    ex = "Exercise 4.4"
    rng = random.Random(seed)
    cases = [([4, 1, 1, 1, 1, 4], 3), ([1, 1, 1, 9], 2), ([3], 1), ([2, 2, 2, 2], 4),
             ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3), ([10, 1, 1, 1, 1, 1, 1, 10], 2)]
    for _ in range(trials):
        n = rng.randint(1, 10)
        cases.append(([rng.randint(0, 20) for _ in range(n)], rng.randint(1, n)))
    answers = yield here(partitions, partition, cases)
    for (costs, p), answer in zip(cases, answers):
        if "raised" in answer:
            raise checks.CheckFailed(f"{ex}: partition({costs}, p={p}) raised "
                                     f"{answer['raised']}: {answer['message']}")
        got = [rebuilt(r) for r in answer["value"]]
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
    return f"{len(cases)} cost lists against brute force"
