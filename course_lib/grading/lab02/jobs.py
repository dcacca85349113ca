"""What Lab 02's checks run on the student's ranks (or in its process): the student's
code on the deterministic inputs of :mod:`.references`, reported as plain data.
Nothing here compares: the checks do, with references of their own."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.ddp import DDP
from course_lib.ddp.buckets import Bucket
from course_lib.ddp.comm_hooks import GradBucket
from course_lib.grading.lab02.references import LR, STEPS, data, model, shard


def train(wrap, sync=None, kind="mlp"):
    """STEPS SGD steps of ``wrap(model)`` from per-rank weights (rank 0's are the
    reference's), ``sync(model)`` after each backward: parameters, gradients, and
    what the wrapper launched (``launched``, and after each gradient hook of the
    last step, how many buckets were launched so far)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model(kind, seed=0 if rank == 0 else 1000 + rank)
    ddp = wrap(net)
    hooks_seen = []  # after each gradient hook of the last step: buckets launched so far
    for p in net.parameters():  # registered after the student's: they run after them
        p.register_post_accumulate_grad_hook(
            lambda _: hooks_seen.append(len(getattr(ddp, "launched", []))))
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = data(world)
    mine = shard(rank)
    first_grads = None
    for _ in range(STEPS):
        opt.zero_grad()
        hooks_seen.clear()
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        if sync is not None:
            sync(net)
        if first_grads is None:
            first_grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
    return dict(params=[p.detach() for p in net.parameters()], first_grads=first_grads,
                grads=[p.grad.clone() for p in net.parameters()], hooks_seen=list(hooks_seen),
                launched=list(getattr(ddp, "launched", [])),
                buckets=len(getattr(ddp, "buckets", [])))


def broadcast_then(net):
    for p in net.parameters():
        dist.broadcast(p.data, src=0)
    return net


def averaged(average_gradients):
    """Exercise 2.1: rank 0's weights broadcast, then the student's averaging."""
    return train(broadcast_then, average_gradients)


def bucketed(make_ddp, cap_mb):
    """Exercise 2.3: the student's DDP, one layer per bucket, on the use-order model."""
    return train(lambda net: make_ddp(net, cap_mb), kind="use_order")


def bucket_plans(assign_buckets, cases):
    """Exercise 2.2: ``assign_buckets(sizes, cap)`` for each case, each plan as lists
    where it is a list of iterables (``{"value": ...}`` or ``{"raised": ...}``)."""
    answers = []
    for sizes, cap in cases:
        try:
            got = assign_buckets(list(sizes), cap)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the answer, for the check to judge
            answers.append({"raised": type(exc).__name__, "message": str(exc)[:500]})
            continue
        try:
            got = [list(b) for b in got]
        except TypeError:
            pass  # not a list of buckets: the check says so
        answers.append({"value": got})
    return answers


def _counting_ddp(net, launches):
    def all_reduce(tensor):
        launches.append(tensor.numel())
        return dist.all_reduce(tensor, async_op=True)
    return DDP(net, bucket_cap_mb=64, all_reduce=all_reduce)


def accumulate(train_step, micro_batches):
    """Exercise 2.4: the student's step on the library's DDP, all-reduces counted."""
    rank, world = dist.get_rank(), dist.get_world_size()
    launches = []
    ddp = _counting_ddp(model("mlp", seed=0 if rank == 0 else 1000 + rank), launches)
    rows = []  # the rows of each forward pass: micro-batching shows here, not in the values
    ddp.module.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    x, y = data(world)
    mine = shard(rank)
    first_grads, per_step, forwards = None, [], []
    for _ in range(STEPS):
        before, seen = len(launches), len(rows)
        train_step(ddp, opt, x[mine], y[mine], micro_batches)
        per_step.append(len(launches) - before)
        forwards.append(rows[seen:])
        if first_grads is None:
            first_grads = [p.grad.clone() for p in ddp.parameters()]
    return dict(params=[p.detach() for p in ddp.module.parameters()], first_grads=first_grads,
                grads=[p.grad.clone() for p in ddp.module.parameters()], per_step=per_step,
                forwards=forwards)


def run_hook(hook, numel):
    """Exercise 2.5: the student's hook on one bucket of known gradients (this rank's of
    :func:`~.references.hook_inputs`); what its future gave, a tensor or its type."""
    rank = dist.get_rank()
    param = torch.nn.Parameter(torch.zeros(numel, device="cpu"))
    bucket = Bucket(0, [param])
    bucket.buffer.copy_(torch.randn(numel, generator=torch.Generator(device="cpu")
                                    .manual_seed(rank), device="cpu"))
    value = hook(None, GradBucket(bucket, is_last=True)).wait()
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if isinstance(value, torch.Tensor):
        return value.detach().clone().as_subclass(torch.Tensor)
    return {"type": type(value).__name__}


def hook_training(hook):
    """The library's DDP with ``hook`` (small buckets): the averaged gradients of every
    step, and the bucket each parameter sat in."""
    net = model("mlp", seed=0)
    ddp = DDP(net, bucket_cap_mb=0.01)
    ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    x, y = data(dist.get_world_size())
    mine = shard(dist.get_rank())
    steps = []
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        # the gradients tell more than the weights: SGD moves a weight by lr x gradient
        steps.append([p.grad.clone() for p in ddp.module.parameters()])
    bucket_of = {i: k for k, plan in enumerate(ddp.bucket_plan) for i in plan}
    return {"steps": steps, "bucket_of": bucket_of}
