"""What the check of Exercise 2.6 (a whole DDP class) runs on ranks, reported as plain data.

:func:`ddp_job` runs the student's class on the student's ranks; :func:`torch_reference`
runs torch's ``DistributedDataParallel`` on the same models and shards, in the checking
process's own job. Neither compares anything. Ranks start from different weights (rank
0's are the reference's), so a class that does not broadcast them shows it.

The order of events on a rank is read from one list, not from clocks: hooks registered
on the parameters *before* the student's class wraps the model (so each runs just before
the class's own hook on the same parameter) log ``("grad", i)``, a callback they queue
logs ``("end",)`` when backward has computed every gradient, and
:func:`~course_lib.ddp.watch.watching_all_reduces` logs each ``dist.all_reduce``.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib import trace
from course_lib.ddp.buckets import grad_or_zeros
from course_lib.ddp.watch import watching_all_reduces
from course_lib.grading.lab02.references import shard as slice_of_rank
from course_lib.models import deep_mlp, init_deterministic

STEPS, ROWS, MICRO, LR = 3, 6, 3, 0.1  # ROWS per rank, cut into MICRO equal micro-batches
INPUTS, WIDTH, OUTPUTS = 13, 19, 7
CAP_BYTES = 600  # 150 floats: buckets of 159, 361, 380 and 266 (a layer's bias and weight apart)
CAP_MB = CAP_BYTES / 2**20  # exact in binary: int(CAP_MB * 2**20) == CAP_BYTES


def model(seed):
    """Four Linear layers of awkward sizes (13 -> 19 -> 19 -> 19 -> 7)."""
    return deep_mlp(WIDTH, 3, inputs=INPUTS, outputs=OUTPUTS, seed=seed)


class WithUnusedLayer(nn.Module):
    """Two Linear layers used, and between them, registered but never called, a third
    (a branch not taken): its hooks never fire."""

    def __init__(self, seed):
        super().__init__()
        self.first = nn.Linear(INPUTS, WIDTH)
        self.skipped = nn.Linear(WIDTH, WIDTH)
        self.last = nn.Linear(WIDTH, OUTPUTS)
        init_deterministic(self, seed)

    def forward(self, x):
        return self.last(torch.relu(self.first(x)))


def batch(world):
    gen = torch.Generator(device="cpu").manual_seed(11)
    return (torch.randn(ROWS * world, INPUTS, generator=gen, device="cpu"),
            torch.randn(ROWS * world, OUTPUTS, generator=gen, device="cpu"))


def shard(rank):
    return slice_of_rank(rank, ROWS)


def seed_of(rank):
    return 0 if rank == 0 else 1000 + rank


def grads_of(module):
    return [grad_or_zeros(p).detach().clone() for p in module.parameters()]


# ---- on the student's ranks ----------------------------------------------------------------
class _GradientProbe:
    """Logs ``("grad", i)`` as parameter i's gradient is accumulated and ``("end",)`` when
    backward has finished computing gradients (queued from its first hook, so before any
    callback the wrapper queues later)."""

    def __init__(self, module, events):
        self.events, self.queued = events, False
        for index, p in enumerate(module.parameters()):
            p.register_post_accumulate_grad_hook(functools.partial(self._hook, index))

    def _hook(self, index, _param):
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        self.events.append(("grad", index))

    def _end(self):
        self.queued = False
        self.events.append(("end",))


def _summary(events, works):
    """One backward's events as counts: the all-reduces' sizes in issue order, how many
    blocked (``async_op=False``), started before the last gradient hook or after the
    end of backward, and were never waited for."""
    last_grad = max((i for i, e in enumerate(events) if e[0] == "grad"), default=len(events))
    end = next((i for i, e in enumerate(events) if e[0] == "end"), len(events))
    reduces = [e for e in events if e[0] == "all_reduce"]
    return {"sizes": [e[1] for e in reduces], "blocking": sum(not e[2] for e in reduces),
            "before_last_grad": sum(e[0] == "all_reduce" for e in events[:last_grad]),
            "after_end": sum(e[0] == "all_reduce" for e in events[end:]),
            "unwaited": sum(not w.waited for w in works)}


def _synced(make_ddp, x, y, rank):
    """STEPS SGD steps: the weights right after construction, then per step what backward
    issued and the gradients it left."""
    net, events = model(seed_of(rank)), []
    _GradientProbe(net, events)
    ddp = make_ddp(net, bucket_cap_mb=CAP_MB)
    out = {"start": [p.detach().clone() for p in net.parameters()], "steps": []}
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        events.clear()
        with watching_all_reduces(events) as works:
            F.mse_loss(ddp(x), y).backward()
        out["steps"].append({**_summary(events, works), "grads": grads_of(net)})
        opt.step()
    return out


def _accumulated(make_ddp, x, y, rank):
    """One step in MICRO micro-batches, all but the last inside ``no_sync()``."""
    net = model(seed_of(rank))
    ddp = make_ddp(net, bucket_cap_mb=CAP_MB)
    events, inside = [], 0
    with watching_all_reduces(events):
        for i, (xs, ys) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
            if i < MICRO - 1:
                with ddp.no_sync():
                    (F.mse_loss(ddp(xs), ys) / MICRO).backward()
                inside = len(events)
            else:
                (F.mse_loss(ddp(xs), ys) / MICRO).backward()
    return {"inside": inside, "grads": grads_of(net)}


def _with_unused(make_ddp, x, y, rank):
    """Two SGD steps of :class:`WithUnusedLayer`: the gradients, or what was raised."""
    net = WithUnusedLayer(seed_of(rank))
    try:
        ddp = make_ddp(net, bucket_cap_mb=CAP_MB)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        steps = []
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            steps.append(grads_of(net))
            opt.step()
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - every rank raises alike; the check explains it
        return {"raised": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {"steps": steps}


def ddp_job(ddp_cls):
    """The student's ``ddp_cls(module, bucket_cap_mb=...)`` on this rank's shard: STEPS
    synchronised steps, one accumulated with ``no_sync()``, and a model with a layer
    forward never uses."""
    rank = dist.get_rank()
    x, y = batch(dist.get_world_size())
    x, y = x[shard(rank)], y[shard(rank)]
    with trace.paused():  # a traced handle would ask each work for its future: not a wait
        return {"synced": _synced(ddp_cls, x, y, rank),
                "no_sync": _accumulated(ddp_cls, x, y, rank),
                "unused": _with_unused(ddp_cls, x, y, rank)}


# ---- in the checking process's own job -----------------------------------------------------
def torch_reference():
    """What :func:`ddp_job` reports, from torch's DistributedDataParallel (the unused layer
    with ``find_unused_parameters=True``, which torch needs for it)."""
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    x, y = batch(dist.get_world_size())
    x, y = x[shard(rank)], y[shard(rank)]

    def steps(net, count, **options):
        ddp = DistributedDataParallel(net, bucket_cap_mb=CAP_MB, **options)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        grads = []
        for _ in range(count):
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            grads.append(grads_of(net))
            opt.step()
        return grads

    return {"synced": steps(model(seed_of(rank)), STEPS),
            "unused": steps(WithUnusedLayer(seed_of(rank)), 2, find_unused_parameters=True)}
