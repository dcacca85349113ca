"""The check of Lab 03's ZeRO-2, written from a blank page (Exercise 3.11).

The student's class trains a small MLP (sizes that no world size divides) on real
gloo ranks, at world sizes 2 and 3, twice: with AdamW, whose state per rank is
measured, and with plain SGD, which, unlike Adam, shows whether the gradient was
averaged or only summed. :func:`zero2_job` reports parameters, collective counts,
the optimizer's state and the gradient bytes still held after each step; the check
compares with one process training on the whole batch, computed here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.grading import checks, salt, wire
from course_lib.grading.requests import on_ranks
from course_lib.models import deep_mlp

STEPS, ROWS, LR = 3, 4, 1e-2
# eps=1e-4, not torch's 1e-8: an element whose gradient is within rounding of zero would
# otherwise step by anything in [-lr, lr] with the order the ranks' gradients were summed
# in (about one seed in a hundred failed a right answer)
OPTIMIZERS = {"AdamW": lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.1,
                                                         eps=1e-4),
              "SGD": lambda params: torch.optim.SGD(params, lr=LR * 10)}


def _model():
    return deep_mlp(17, 2, inputs=13, outputs=5, seed=0)  # 17, 13, 5: no world size divides


def _batch(world):
    gen = torch.Generator(device="cpu").manual_seed(3)
    return (torch.randn(ROWS * world, 13, generator=gen, device="cpu"),
            torch.randn(ROWS * world, 5, generator=gen, device="cpu"))


def _bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


# ---- on the student's ranks ------------------------------------------------------------------
def zero2_job(zero2_cls):
    """For each optimizer: train ``STEPS`` steps with ``zero2_cls(params, make_optimizer)``;
    report the parameters, the collectives counted, the parameters and state of the
    optimizer(s) it made, and the gradient bytes held after each step."""

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _batch(world)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    out = {}
    for name, make in OPTIMIZERS.items():
        model, made = _model(), []

        def make_optimizer(params, make=make):
            made.append(make(params))  # kept, to see what it steps and the state it holds
            return made[-1]

        zero2 = zero2_cls(model.parameters(), make_optimizer)
        held = []
        with wire.counting() as stats:
            for _ in range(STEPS):
                zero2.zero_grad()
                F.mse_loss(model(x[mine]), y[mine]).backward()
                zero2.step()
                stepped = [p for opt in made for g in opt.param_groups for p in g["params"]]
                held.append({"model": _bytes(p.grad for p in model.parameters()),
                             "optimizer": _bytes(p.grad for p in stepped)})
        stepped = [p for opt in made for g in opt.param_groups for p in g["params"]]
        state = sum(t.numel() * t.element_size() for opt in made for s in opt.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.numel() > 1)
        report = stats.as_dict()
        out[name] = {"params": [p.detach().clone() for p in model.parameters()],
                     "collectives": report["collectives"], "optimizers": len(made),
                     "stepped_numel": sum(p.numel() for p in stepped), "state": state,
                     "held": held, "traffic": report}
    return out


# ---- the check -------------------------------------------------------------------------------
def _reference(name, world, scale=1.0):
    """Parameters after one process trains on the whole batch (``scale``: the gradient
    multiplied by it before each step, as a sum over ranks instead of a mean would)."""
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    x, y = _batch(world)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        for p in model.parameters():
            p.grad.mul_(scale)
        opt.step()
    return [p.detach() for p in model.parameters()]


def _same(got, want):
    return len(got) == len(want) and all(g.shape == w.shape and torch.allclose(
        g, w, rtol=1e-4, atol=1e-5) for g, w in zip(got, want))


def _judge_counts(ex, n, calls):
    where = f"{ex}: with world size {n}, {STEPS} steps"
    if calls.get("all_reduce"):
        raise checks.CheckFailed(
            f"{where}: your class all-reduced ({calls['all_reduce']} all-reduces), as ZeRO-1 "
            f"behind DDP does.\nHint: ZeRO-2 reduce-scatters the flat gradient: rank r "
            f"receives only shard r of the sum, the one its optimizer steps, so no rank ever "
            f"holds the whole averaged gradient (and the bytes sent are half an all-reduce's).",
            exercise=ex)
    if calls.get("reduce_scatter", 0) != STEPS or calls.get("all_gather", 0) != STEPS:
        raise checks.CheckFailed(
            f"{where}: expected {STEPS} reduce-scatters and {STEPS} all-gathers (one of each "
            f"per step) through collective_ops(), counted {calls or 'none'}.\nHint: ops = "
            f"collective_ops(); ops.reduce_scatter(shard_grad, flat_grad) after backward, "
            f"ops.all_gather(flat_params, shard) after the optimizer step. Without the "
            f"all-gather each rank updates only its own shard and the ranks drift apart.",
            exercise=ex)


@checks.check("Exercise 3.11", hidden=salt.draw)
def check_zero2(zero2_cls, world_sizes=(2, 3)):
    ex = "Exercise 3.11"
    for n in world_sizes:
        outs = yield on_ranks(zero2_job, zero2_cls, nproc=n, timeout=120)
        numel = sum(p.numel() for p in _model().parameters())
        shard = -(-numel // n)
        for name in OPTIMIZERS:
            want = _reference(name, n)
            for rank, out in enumerate(o[name] for o in outs):
                where = f"{ex}: rank {rank} of world size {n}, {STEPS} {name} steps"
                _judge_counts(ex, n, out["collectives"])
                if out["optimizers"] != 1:
                    raise checks.CheckFailed(
                        f"{where}: make_optimizer was called {out['optimizers']} times.\nHint: "
                        f"build the optimizer once, in __init__, over [shard].", exercise=ex)
                if out["stepped_numel"] != shard:
                    raise checks.CheckFailed(
                        f"{where}: the optimizer was handed {out['stepped_numel']} elements, "
                        f"this rank's shard has {shard} ({numel} parameters padded to "
                        f"{shard * n}, split in {n}).\nHint: each rank steps only its shard: "
                        f"make_optimizer([shard]) with shard an nn.Parameter holding the slice "
                        f"shard_bounds gives this rank.", exercise=ex)
                got = out["params"]
                if not _same(got, want):
                    if rank and _same(outs[0][name]["params"], want):
                        why = ("rank 0 is right but this rank's parameters differ: copy every "
                               "parameter's part of the all-gathered flat buffer back")
                    elif _same(got, _reference(name, n, scale=n)):
                        why = (f"the parameters match a gradient {n} times too large: the "
                               f"reduce-scatter sums the ranks' gradients, divide the shard by "
                               f"the world size to average them")
                    else:
                        why = ("reduce-scatter the padded flat gradient into this rank's shard, "
                               "divide by n, step, all-gather the shards and copy each "
                               "parameter's part back (under torch.no_grad())")
                    for i, (g, w) in enumerate(zip(got, want)):
                        checks.expect_close(ex, g, w, rank=rank, world_size=n, rtol=1e-4,
                                            atol=1e-5, what=f"parameter {i} after {STEPS} "
                                            f"{name} steps (vs one process on the whole batch)",
                                            hint=why)
                    raise checks.CheckFailed(f"{where}: the parameters differ from one process "
                                             f"training on the whole batch.\nHint: {why}",
                                             exercise=ex)
                if name == "AdamW":
                    checks.expect_equal(ex, out["state"], 8 * shard, rank=rank, world_size=n,
                                        what="bytes of AdamW state on this rank (exp_avg and "
                                             "exp_avg_sq of its shard)")
                for step, held in enumerate(out["held"], 1):
                    if held["model"]:
                        raise checks.CheckFailed(
                            f"{where}: after step {step} the model's parameters still hold "
                            f"{held['model']:,} bytes of full gradients.\nHint: ZeRO-2 keeps "
                            f"only the shard's gradient: once the flat gradient is "
                            f"reduce-scattered, set every p.grad = None.", exercise=ex)
                    if held["optimizer"] > 4 * shard:
                        raise checks.CheckFailed(
                            f"{where}: after step {step} the shard's gradient keeps "
                            f"{held['optimizer']:,} bytes alive, more than the {4 * shard:,} "
                            f"of one shard: it is a view of a larger tensor.\nHint: reduce-"
                            f"scatter into a new tensor of the shard's size.", exercise=ex)
    return (f"world sizes {list(world_sizes)}, {STEPS} AdamW and SGD steps as one process, "
            f"one reduce-scatter and one all-gather per step, 1/n of the state and gradient")
