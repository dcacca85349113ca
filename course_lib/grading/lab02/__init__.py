"""Checks of Lab 02's exercises: data-parallel training from scratch.

Correctness is always against a single process training the same model on the
whole (concatenated) batch, computed here (:mod:`.references`), never on the
student's ranks. Ranks start from *different* random weights, so a missing
initial broadcast shows up, and gradients are compared across ranks. The first
step's gradient is compared with the full-batch one before anything else, so
that a factor (the sum instead of the average) is named as a factor.

- :mod:`.jobs`: what runs on the student's ranks (or in its process) and reports;
- :mod:`.references`: the inputs and the expected values;
- :mod:`.messages`: hints and diagnoses;
- :mod:`.predictions`: Predictions 2.1 and 2.2;
- :mod:`.blank_page`: Exercise 2.6, a whole DDP class against torch's.
"""
from __future__ import annotations

import torch

from course_lib.grading import checks, salt
from course_lib.grading.lab02 import jobs, messages, references
from course_lib.grading.lab02.blank_page import check_ddp_from_blank_page  # noqa: F401
from course_lib.grading.lab02.predictions import (check_bytes_per_step_prediction,  # noqa: F401
                                                  check_gradient_ratio_prediction)
from course_lib.grading.lab02.references import (DEPTH, HAND_CASES, LAYER_BYTES, LR,  # noqa: F401
                                                 PER_RANK, STEPS, WIDTH)
from course_lib.grading.requests import here, on_ranks


def grade_training(ex, outs, world, hint, kind="mlp"):
    """Each rank's training (a :func:`.jobs.train` answer) against one process on the whole
    batch: the first gradient (diagnosed), the parameters after STEPS steps, and every
    rank's last gradients against rank 0's."""
    expected, want_first = references.single_process(world, kind)
    local = references.local_first_grads(world, kind)
    names = [f"parameter {i} ({tuple(p.shape)})" for i, p in enumerate(expected)]
    for rank, out in enumerate(outs):
        messages.diagnose_gradient(ex, out["first_grads"], want_first, local, rank, world, hint)
        for name, got, want in zip(names, out["params"], expected):
            checks.expect_close(ex, got, want, rank=rank, world_size=world, rtol=1e-4, atol=1e-5,
                                what=f"{name} after {STEPS} SGD steps (vs one process on the "
                                     f"whole batch)", hint=hint)
        for name, got, ref in zip(names, out["grads"], outs[0]["grads"]):
            checks.expect_close(ex, got, ref, rank=rank, world_size=world, rtol=0, atol=0,
                                what=f"the gradient of {name}, compared with rank 0's",
                                hint=messages.SAME_GRADIENTS_HINT)


@checks.check("Exercise 2.1", hidden=salt.draw)
def check_average_gradients(average_gradients, world_sizes=(1, 2, 3)):
    ex = "Exercise 2.1"
    for n in world_sizes:
        outs = yield on_ranks(jobs.averaged, average_gradients, nproc=n)
        grade_training(ex, outs, n, messages.AVERAGE_HINT)
    return f"world sizes {list(world_sizes)}, {STEPS} steps equal to one process"


@checks.check("Exercise 2.2", hidden=checks.reseeded)
def check_assign_buckets(assign_buckets, trials=200, seed=0):
    ex = "Exercise 2.2"
    cases = references.bucket_cases(trials, seed)
    answers = yield here(jobs.bucket_plans, assign_buckets, [(list(s), c) for s, c in cases])
    for (sizes, cap), answer in zip(cases, answers):
        call = f"assign_buckets({sizes}, cap_bytes={cap})"
        if "raised" in answer:
            raise checks.CheckFailed(f"{ex}: {call} raised {answer['raised']}: "
                                     f"{answer['message']}", exercise=ex)
        got = answer["value"]
        problem = messages.diagnose_buckets(sizes, cap, got)
        if problem:
            raise checks.CheckFailed(f"{ex}: {call} returned {got}: {problem}", exercise=ex)
    return f"{len(HAND_CASES)} hand-checked cases and {trials} random ones"


@checks.check("Exercise 2.3", hidden=salt.draw)
def check_bucketed_ddp(make_ddp, world_sizes=(1, 2, 3)):
    """On a model whose layers run in another order than they are registered
    (so bucket 1 completes before bucket 0), one layer per bucket."""
    ex = "Exercise 2.3"
    for n in world_sizes:
        outs = yield on_ranks(jobs.bucketed, make_ddp, LAYER_BYTES / 2**20, nproc=n)
        grade_training(ex, outs, n, messages.BUCKETED_HINT, kind="use_order")
        for rank, out in enumerate(outs):
            launched, buckets = out["launched"], out["buckets"]
            problem = messages.launch_order_problem(ex, rank, n, launched, buckets)
            if problem:
                raise checks.CheckFailed(problem)
            checks.expect_equal(ex, launched, list(range(buckets)), rank=rank, world_size=n,
                                what="the order the buckets were launched in (last step)",
                                hint="every bucket once per backward, in bucket order")
            seen = out["hooks_seen"]
            if buckets > 1 and len(seen) > 1 and seen[-2] == 0:
                raise checks.CheckFailed(messages.no_overlap(ex, rank, n))
    return (f"world sizes {list(world_sizes)}, {outs[0]['buckets']} buckets launched in order "
            f"during backward")


@checks.check("Exercise 2.4", hidden=salt.draw)
def check_accumulation(train_step, world_sizes=(1, 2, 3), micro_batches=(2, 4)):
    ex = "Exercise 2.4"
    for n in world_sizes:
        for k in micro_batches:
            outs = yield on_ranks(jobs.accumulate, train_step, k, nproc=n)
            for rank, out in enumerate(outs):
                if out["per_step"][0] > 1:
                    raise checks.CheckFailed(
                        messages.no_sync_problem(ex, rank, n, k, out["per_step"][0]))
                if len(out["forwards"][0]) != k:
                    raise checks.CheckFailed(
                        f"{ex}: rank {rank} of world size {n}, {k} micro-batches: one step "
                        f"ran the model {len(out['forwards'][0])} time(s), on "
                        f"{out['forwards'][0]} rows.\nHint: accumulation runs a forward and "
                        f"a backward per micro-batch (k of them, each on 1/k of the rows), "
                        f"and steps once.", exercise=ex)
            grade_training(ex, outs, n, messages.accumulation_hint(k))
    return (f"world sizes {list(world_sizes)}, {list(micro_batches)} micro-batches, one "
            f"all-reduce per step, equal to one process on the whole batch")


@checks.check("Exercise 2.5", hidden=salt.draw)
def check_bf16_hook(hook, world_sizes=(1, 2, 3), numel=1001):
    ex = "Exercise 2.5"
    for n in world_sizes:
        outs = yield on_ranks(jobs.run_hook, hook, numel, nproc=n)
        average = sum(references.hook_inputs(n, numel)) / n
        for rank, got in enumerate(outs):
            _grade_reduced_bucket(ex, got, average, rank, n, numel)
        trained = yield on_ranks(jobs.hook_training, hook, nproc=n)
        theirs = checks.reference_ranks(references.torch_hook_training, nproc=n)
        for rank, (out, ref) in enumerate(zip(trained, theirs)):
            messages.diagnose_hook_training(ex, out["steps"], ref["steps"], ref["bucket_of"],
                                            rank, n)
    return (f"world sizes {list(world_sizes)}: bf16 on the wire, averaged, and {STEPS} DDP "
            f"steps as torch's bf16_compress_hook")


def _grade_reduced_bucket(ex, got, average, rank, n, numel):
    """One rank's answer of :func:`.jobs.run_hook` against the float32 average."""
    where = f"{ex}: rank {rank} of world size {n}"
    if not isinstance(got, torch.Tensor):
        kind = got["type"] if isinstance(got, dict) and "type" in got else type(got).__name__
        raise checks.CheckFailed(f"{where}: the hook's future gave {kind}, not a tensor.\nHint: "
                                 f"return a future whose value is the bucket's averaged buffer.")
    checks.expect_equal(ex, (tuple(got.shape), got.dtype), ((numel,), torch.float32),
                        rank=rank, world_size=n, what="shape and dtype of the reduced bucket",
                        hint="cast the bf16 result back into the float32 buffer "
                             "(bucket.buffer().copy_(...)) and return that")
    scale = messages.ratio([got], [average], rtol=2e-2, atol=0.03 * n)
    if scale is not None and abs(scale - 1) > 0.05:
        raise checks.CheckFailed(f"{where}: the reduced bucket is {scale:.2f}x the average.\n"
                                 f"Hint: divide by the group's size once "
                                 f"(dist.get_world_size(process_group)).")
    if not torch.equal(got, got.to(torch.bfloat16).float()):
        raise checks.CheckFailed(f"{where}: the reduced values are not bfloat16 numbers, so the "
                                 f"all-reduce sent float32.\nHint: all-reduce "
                                 f"`bucket.buffer().to(torch.bfloat16)`.")
    # bf16 keeps 8 significant bits: n roundings of |x| up to ~4 stay within this
    checks.expect_close(ex, got, average, rank=rank, world_size=n, rtol=0, atol=0.03 * n,
                        what="the averaged bucket (vs float32 average)",
                        hint="SUM all-reduce of the bf16 buffer divided by the size")
