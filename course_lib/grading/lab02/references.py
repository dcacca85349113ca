"""Lab 02's inputs and expected values, computed in the checking process.

The models and the batch are deterministic (seeded, on the CPU): the jobs build
the same ones on the student's ranks. The expected values come from one process
training on the whole (concatenated) batch, never from the student's ranks; the
one reference that needs real ranks (torch's ``bf16_compress_hook`` inside DDP)
runs in the checking process's own job (:func:`torch_hook_training`).
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from course_lib.models import UseOrderMLP, deep_mlp

STEPS, PER_RANK, WIDTH, DEPTH, LR = 3, 4, 48, 3, 0.2
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one Linear of the use-order model, fp32
HAND_CASES = [([40, 40, 40, 40], 80), ([10, 100, 10], 50), ([5, 5, 5], 1000), ([7], 1),
              ([], 10), ([30, 50, 20, 60], 80)]


# ---- inputs (built the same way on the student's ranks) ----------------------------------------
def model(kind, seed):
    if kind == "use_order":  # layers used in another order than registered
        return UseOrderMLP(WIDTH, use_order=(0, 1, 3, 2), seed=seed)
    return deep_mlp(WIDTH, DEPTH, inputs=WIDTH, outputs=WIDTH, seed=seed)


def data(world):
    gen = torch.Generator(device="cpu").manual_seed(7)
    return (torch.randn(PER_RANK * world, WIDTH, generator=gen, device="cpu"),
            torch.randn(PER_RANK * world, WIDTH, generator=gen, device="cpu"))


def shard(rank, rows=PER_RANK):
    """The rows of the batch that rank ``rank`` trains on, ``rows`` per rank."""
    return slice(rank * rows, (rank + 1) * rows)


def bucket_cases(trials, seed=0):
    """(sizes, cap) cases of Exercise 2.2: the hand-checked ones, then random ones."""
    rng = random.Random(seed)
    cases = list(HAND_CASES)
    for _ in range(trials):
        cases.append(([rng.randint(1, 100) for _ in range(rng.randint(1, 30))],
                      rng.randint(1, 400)))
    return cases


def hook_inputs(world, numel):
    """Each rank's bucket of gradients for Exercise 2.5's single-bucket test."""
    return [torch.randn(numel, generator=torch.Generator(device="cpu").manual_seed(rank),
                        device="cpu") for rank in range(world)]


# ---- expected values ---------------------------------------------------------------------------
def single_process(world, kind="mlp"):
    """Parameters after each step and the first step's gradients, one process."""
    net = model(kind, seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = data(world)
    first_grads = None
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        if first_grads is None:
            first_grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
    return [p.detach() for p in net.parameters()], first_grads


def local_first_grads(world, kind="mlp"):
    """Each rank's own gradient at step 1 (its shard only, nothing averaged)."""
    x, y = data(world)
    out = []
    for rank in range(world):
        net = model(kind, seed=0)
        F.mse_loss(net(x[shard(rank)]), y[shard(rank)]).backward()
        out.append([p.grad.clone() for p in net.parameters()])
    return out


def expected_buckets(sizes, cap):
    """The exercise's rule: from the last parameter to the first, close a bucket with
    the parameter that takes it to at least ``cap``; the rest is the last bucket."""
    buckets, current, filled = [], [], 0
    for index in reversed(range(len(sizes))):
        current.append(index)
        filled += sizes[index]
        if filled >= cap:
            buckets.append(current)
            current, filled = [], 0
    return buckets + ([current] if current else [])


def torch_hook_training():
    """On each rank of the checking process's own job: the library's DDP with torch's
    ``bf16_compress_hook``, as :func:`~course_lib.grading.lab02.jobs.hook_training`
    trains it with the student's hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    from course_lib.grading.lab02.jobs import hook_training

    return hook_training(bf16_compress_hook)
