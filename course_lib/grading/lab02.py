"""Checks of Lab 02's exercises: data-parallel training from scratch.

Correctness is always against a single process training the same model on the
whole (concatenated) batch. Ranks start from *different* random weights, so a
missing initial broadcast shows up, and gradients are compared across ranks.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.grading import checks
from course_lib.data import regression_batch
from course_lib.models import deep_mlp

STEPS, PER_RANK, WIDTH, DEPTH, LR = 3, 4, 48, 3, 0.2


def _single_process(world):
    model = deep_mlp(WIDTH, DEPTH, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = regression_batch(PER_RANK * world, seed=7)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _train(wrap, sync=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = deep_mlp(WIDTH, DEPTH, seed=0 if rank == 0 else 1000 + rank)
    ddp = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = regression_batch(PER_RANK * world, seed=7)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        if sync is not None:
            sync(model)
        opt.step()
    return ([p.detach() for p in model.parameters()], [p.grad.clone() for p in model.parameters()],
            list(getattr(ddp, "launched", [])), len(getattr(ddp, "buckets", [])))


def _broadcast_then(model):
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    return model


def _grade_training(ex, outs, world, hint):
    expected = _single_process(world)
    names = [f"parameter {i} ({tuple(p.shape)})" for i, p in enumerate(expected)]
    for rank, (params, grads, _, _) in enumerate(outs):
        for name, got, want in zip(names, params, expected):
            checks.expect_close(ex, got, want, rank=rank, world_size=world, rtol=1e-4, atol=1e-5,
                                what=f"{name} after {STEPS} SGD steps (vs one process on the "
                                     f"whole batch)", hint=hint)
        for name, got, ref in zip(names, grads, outs[0][1]):
            checks.expect_close(ex, got, ref, rank=rank, world_size=world, rtol=0, atol=0,
                                what=f"the gradient of {name}, compared with rank 0's",
                                hint="every rank must end backward with the same averaged "
                                     "gradients")


def check_average_gradients(average_gradients, world_sizes=(1, 2, 3)):
    ex = "Exercise 2.1"
    for n in world_sizes:
        outs = checks.launch(ex, _train, _broadcast_then, average_gradients, nproc=n)
        _grade_training(ex, outs, n, "all-reduce (SUM) each p.grad, then divide by the world "
                                     "size: the average, not the sum")
    checks.passed(ex, f"world sizes {list(world_sizes)}, {STEPS} steps equal to one process")


def check_assign_buckets(assign_buckets, trials=200):
    ex = "Exercise 2.2"
    cases = [([40, 40, 40, 40], 80, [[3, 2], [1, 0]]),
             ([10, 100, 10], 50, [[2, 1], [0]]),
             ([5, 5, 5], 1000, [[2, 1, 0]]),
             ([7], 1, [[0]]),
             ([], 10, [])]
    for sizes, cap, want in cases:
        got = assign_buckets(sizes, cap)
        checks.expect_equal(ex, [list(b) for b in got], want, rank=0, world_size=1,
                            what=f"assign_buckets({sizes}, cap_bytes={cap})",
                            hint="walk the parameters from last to first; close a bucket as "
                                 "soon as it holds at least cap_bytes")
    rng = random.Random(0)
    for _ in range(trials):
        sizes = [rng.randint(1, 100) for _ in range(rng.randint(1, 30))]
        cap = rng.randint(1, 400)
        got = [list(b) for b in assign_buckets(sizes, cap)]
        flat = [i for b in got for i in b]
        if flat != list(reversed(range(len(sizes)))):
            raise checks.CheckFailed(f"{ex}: buckets {got} for sizes {sizes} do not list every "
                                     f"parameter once, from last to first")
        for b in got[:-1]:
            total = sum(sizes[i] for i in b)
            if total < cap or total - sizes[b[-1]] >= cap:
                raise checks.CheckFailed(
                    f"{ex}: bucket {b} holds {total} bytes with cap {cap} (sizes {sizes}): "
                    "a bucket closes with the first parameter that takes it to the cap")
    checks.passed(ex, f"{len(cases)} hand-checked cases and {trials} random ones")


def check_bucketed_ddp(make_ddp, world_sizes=(1, 2, 3), cap_mb=0.01):
    ex = "Exercise 2.3"
    for n in world_sizes:
        outs = checks.launch(ex, _train, lambda m: make_ddp(m, cap_mb), nproc=n)
        _grade_training(ex, outs, n, "mark each parameter ready in its hook, launch complete "
                                     "buckets in order, and wait + copy back at the end")
        for rank, (_, _, launched, buckets) in enumerate(outs):
            checks.expect_equal(ex, launched, list(range(buckets)), rank=rank, world_size=n,
                                what="the order the buckets were launched in (last step)",
                                hint="launch bucket i only after buckets 0..i-1, even if it "
                                     "completes first: every rank must issue the same "
                                     "collectives in the same order")
    checks.passed(ex, f"world sizes {list(world_sizes)}, {outs[0][3]} buckets, launched in order")
