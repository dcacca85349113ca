"""Checks of Lab 03's FSDP exercises: a unit built piece by piece (3.5-3.8).

:mod:`course_lib.fsdp.unit` wires the student's pieces into a working unit: 3.5
flattening and sharding runs in the student's process on many shapes; 3.6 (the
all-gather / reduce-scatter autograd Function) and 3.7 (saved-tensor hooks that
free the full parameters between forward and backward, first probed in the
student's process) train the course GPT, one unit per block plus the root, under
torchrun at world sizes 2 and 3, and read the collectives from the counters;
3.8 (which units to prefetch) runs on many cases. The jobs and probes of
:mod:`.jobs` only report plain facts; the checks compare them with one process on
the whole batch and the library's plan, computed here. Prediction 3.1 (the bytes
per step of DDP, ZeRO-1 and FSDP): :mod:`.predictions`.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from course_lib.grading import checks, salt
from course_lib.grading.lab03 import answered
from course_lib.grading.lab03_fsdp.jobs import (UNIT_CFG, UNIT_LR, UNIT_ROWS,  # noqa: F401
                                                UNIT_STEPS, prefetch_plans, probe_hooks,
                                                shard_facts, unit_batch, unit_job,
                                                unit_optimizer)
from course_lib.grading.lab03_fsdp.predictions import check_traffic_prediction  # noqa: F401
from course_lib.grading.requests import here, on_ranks
from course_lib.models import GPT


@checks.check("Exercise 3.5", hidden=checks.reseeded)
def check_flatten_and_shard(flatten_and_shard, trials=60, seed=4):
    ex = "Exercise 3.5"
    rng = random.Random(seed)
    shapes_of = [[(5, 1), (2,)], [(3, 3)], [(1,)], [(2, 3), (4,), (1, 1)]]
    shapes_of += [[tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 2)))
                   for _ in range(rng.randint(1, 4))] for _ in range(trials)]
    cases, wants = [], []
    for i, shapes in enumerate(shapes_of):
        world = [3, 3, 4, 2][i] if i < 4 else rng.randint(1, 5)
        tensors = [torch.randn(shape, generator=torch.Generator(device="cpu").manual_seed(i),
                               device="cpu") for shape in shapes]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        padded = max(-(-flat.numel() // world) * world, world)
        wants.append((torch.cat([flat, torch.zeros(padded - flat.numel())]), padded))
        cases.append((tensors, world))
    answers = yield here(shard_facts, flatten_and_shard, cases)
    for (_, world), shapes, (want, padded), ranks in zip(cases, shapes_of, wants, answers):
        size = padded // world
        what = f"flatten_and_shard(tensors of shapes {shapes}, rank, world={world})"
        for rank, got in enumerate(ranks):
            if "type" in got:
                raise checks.CheckFailed(f"{ex}: {what} should return (shard, padded), "
                                         f"got {got['type']}")
            checks.expect_equal(ex, got["padded"], padded, rank=rank, world_size=world,
                                what=f"{what}: padded size",
                                hint="pad psi up to the next multiple of world (and to at "
                                     "least world: one element per rank)")
            hint = (f"rank r keeps [r*s, (r+1)*s) of the padded buffer, s = padded/world = "
                    f"{size}; the padding is zeros at the end")
            shard = got["shard"]
            if "tensor" not in shard:
                raise checks.CheckFailed(
                    f"{ex}: rank {rank} of world size {world}, {what}: the shard: expected a "
                    f"tensor, got {shard['type']} ({shard['repr']}).\nHint: {hint}", exercise=ex)
            shard = shard["tensor"]
            checks.expect_close(ex, shard, want[rank * size:(rank + 1) * size], rank=rank,
                                world_size=world, what=f"{what}: the shard", hint=hint)
            if got["storage"] > shard.numel() * shard.element_size():
                raise checks.CheckFailed(
                    f"{ex}: {what}: rank {rank}'s shard is a view of a larger buffer "
                    f"({got['storage']} bytes for {shard.numel()} "
                    f"elements), so every rank would still hold the whole unit.\nHint: "
                    f".clone() the slice so the full buffer can be freed.")
    return f"{len(cases)} units, every rank, padding and memory"


def _unit_reference(world):
    """(first-step gradients by name, state after UNIT_STEPS) of one process, whole batch."""
    model = GPT(UNIT_CFG)
    opt = unit_optimizer(model.parameters())
    x, y = unit_batch(world)
    first = None
    for _ in range(UNIT_STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, UNIT_CFG.vocab), y.reshape(-1)).backward()
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return first, model.state_dict()


def _check_unit_run(ex, outs, world, hint):
    grads, state = _unit_reference(world)
    for rank, (got_state, first, layout, padded, _, _) in enumerate(outs):
        for names, size, got in zip(layout, padded, first):
            flat = torch.cat([grads[n].reshape(-1) for n in names])
            want = torch.cat([flat, torch.zeros(size - flat.numel())])
            want = want[rank * (size // world):(rank + 1) * (size // world)]
            unit = names[0].rsplit(".", 2)[0] if names[0].startswith("blocks.") else "root"
            if got.shape == want.shape and want.norm() > 0:
                factor = float(got @ want / (want @ want))
                if world > 1 and abs(factor - world) < 0.05 * world:
                    raise checks.CheckFailed(
                        f"{ex}: rank {rank} of world size {world}, unit {unit}: the shard's "
                        f"gradient after the first backward is {factor:.2f}x the expected one."
                        f"\nHint: the reduce-scatter sums the n ranks' gradients; data "
                        f"parallelism wants their average: divide by n.")
            checks.expect_close(ex, got, want, rank=rank, world_size=world, rtol=1e-4, atol=1e-6,
                                what=f"unit {unit}: its shard's gradient after the first backward "
                                     f"(vs one process on the whole batch)", hint=hint)
        for name, tensor in state.items():
            # AdamW divides by sqrt(v): where a gradient is near 0, the sum's order (a
            # reduce-scatter against one process) moves a weight by up to ~1e-4; a wrong
            # unit is off by a step, lr = 1e-2
            checks.expect_close(ex, got_state[name], tensor, rank=rank, world_size=world,
                                rtol=1e-4, atol=5e-4, what=f"{name} after {UNIT_STEPS} AdamW steps",
                                hint=hint)


@checks.check("Exercise 3.6", hidden=salt.draw)
def check_gather_shards(gather_shards, world_sizes=(2, 3)):
    ex = "Exercise 3.6"
    for n in world_sizes:
        outs = yield on_ranks(unit_job, "gather", gather_shards, nproc=n, timeout=90)
        stats, units = outs[0][4], len(outs[0][3])
        calls = stats["collectives"]
        if calls.get("all_reduce"):
            raise checks.CheckFailed(
                f"{ex}: with world size {n} your backward all-reduced the whole gradient "
                f"({calls['all_reduce']} all-reduces).\nHint: each rank only keeps its shard: "
                f"reduce-scatter gives it exactly its slice, with half the bytes.")
        if calls.get("all_gather", 0) != UNIT_STEPS * units or \
                calls.get("reduce_scatter", 0) != UNIT_STEPS * units:
            raise checks.CheckFailed(
                f"{ex}: with world size {n}, {units} units and {UNIT_STEPS} steps, expected "
                f"{UNIT_STEPS * units} all-gathers and {UNIT_STEPS * units} reduce-scatters "
                f"through ops, saw {dict(calls)}.\nHint: call ops.all_gather(full, shard, "
                f"group=group) in forward and ops.reduce_scatter(grad_shard, grad_full, "
                f"group=group) in backward, once each (ops = collective_ops()).")
        _check_unit_run(ex, outs, n, hint="forward: all-gather the shards into a new (n*s,) "
                                          "tensor; backward: reduce-scatter grad_full into an "
                                          "(s,) tensor, divide by n, return it and None")
    return (f"world sizes {list(world_sizes)}, gradients and {UNIT_STEPS} AdamW steps as one "
            f"process, one all-gather and one reduce-scatter per unit and step")


def _judge_hooks(ex, facts):
    """The probe's facts (:func:`probe_hooks`) as the failure they show, if any."""
    if facts["packed_full"]:
        raise checks.CheckFailed(f"{ex}: pack returned the view of the full parameters itself, "
                                 f"so autograd keeps them alive until backward.\nHint: pack "
                                 f"a view of `full` as (offset, size, stride) instead.")
    if facts["kept"] is not None:
        raise checks.CheckFailed(f"{ex}: pack kept a tensor as large as the view ({facts['kept']} "
                                 f"elements), a copy of the parameters: freeing `full` then "
                                 f"saves nothing.\nHint: keep only where the view lies in "
                                 f"`full` (offset, size, stride) and rebuild it in unpack.")
    if not facts["gathered"]:
        raise checks.CheckFailed(f"{ex}: unpack did not call regather() for a view of the full "
                                 f"parameters, which were freed after forward.\nHint: call "
                                 f"regather() first, then rebuild the view from `full`.")
    if "unpack_raised" in facts:
        kind, message = facts["unpack_raised"]
        raise checks.CheckFailed(f"{ex}: unpack(pack(a view of full)) raised {kind}: {message}")
    back, want = facts["back"], torch.arange(12.0)[2:8].view(2, 3).t()
    if not ("tensor" in back and back["tensor"].shape == want.shape
            and torch.equal(back["tensor"], want)):
        shown = repr(back["tensor"]) if "tensor" in back else back["repr"]
        raise checks.CheckFailed(f"{ex}: unpack(pack(full[2:8].view(2, 3).t())) gave "
                                 f"{shown}, not that view.\nHint: "
                                 f"full.detach().as_strided(size, stride, offset)")
    other = facts["other"]
    if not ("tensor" in other and torch.equal(other["tensor"], torch.ones(3))):
        raise checks.CheckFailed(f"{ex}: a tensor that is not a view of the full parameters "
                                 f"(an activation) must come back unchanged from pack/unpack.")


@checks.check("Exercise 3.7", hidden=salt.draw)
def check_free_between_passes(free_between_passes, world_sizes=(2, 3)):
    ex = "Exercise 3.7"
    _judge_hooks(ex, (yield here(probe_hooks, free_between_passes)))
    for n in world_sizes:
        outs = yield on_ranks(unit_job, "hooks", free_between_passes, nproc=n, timeout=90)
        for rank, out in enumerate(outs):
            whole = [w for w in out[5] if w]
            if whole:
                raise checks.CheckFailed(f"{ex}: rank {rank}: units {whole[0]} were still whole "
                                         f"after forward.\nHint: pack must not return the view.")
        stats, units = outs[0][4], len(outs[0][3])
        checks.expect_equal(ex, stats["collectives"].get("all_gather", 0), 2 * UNIT_STEPS * units,
                            rank=0, world_size=n, what=f"all-gathers in {UNIT_STEPS} steps of "
                                                       f"{units} units",
                            hint="one in forward and one in backward per unit and step: "
                                 "regather() gathers only when the buffer was freed")
        _check_unit_run(ex, outs, n, hint="unpack must rebuild exactly the view that was packed")
    return (f"world sizes {list(world_sizes)}: freed between forward and backward, gathered "
            f"again once, trained as one process")


@checks.check("Exercise 3.8", hidden=checks.reseeded)
def check_prefetch_plan(units_to_prefetch, trials=200, seed=5):
    ex = "Exercise 3.8"
    from course_lib.fsdp import prefetch_targets

    rng = random.Random(seed)
    cases = [(5, 1, 1, False), (5, 3, 1, True), (5, 4, 2, False), (5, 1, 2, True),
             (4, 0, 1, True), (4, 3, 1, False)]
    cases += [(k, rng.randrange(k), rng.randint(0, 3), rng.random() < 0.5)
              for k in (rng.randint(1, 8) for _ in range(trials))]
    orders = [[""] + [f"blocks.{i}" for i in range(units - 1)] for units, _, _, _ in cases]
    calls = [((order, order[at], depth, backward), {})
             for order, (_, at, depth, backward) in zip(orders, cases)]
    answers = yield here(prefetch_plans, units_to_prefetch, calls)
    for order, (_, at, depth, backward), answer in zip(orders, cases, answers):
        want = prefetch_targets(order, order[at], depth, backward)
        what = f"units_to_prefetch({order}, {order[at]!r}, depth={depth}, backward={backward})"
        got = answered(ex, answer, what)
        hint = ("in backward the units run in reverse: the next ones are those before the "
                "current unit in the forward order, nearest first" if backward else
                "in forward the next units are those after the current one")
        if got and sorted(got) == sorted(want) and got != want:
            hint = "the nearest unit computes first: start its all-gather first"
        checks.expect_equal(ex, got, want, rank=0, world_size=1, what=what, hint=hint)
    return f"{len(cases)} cases, forward and backward"
