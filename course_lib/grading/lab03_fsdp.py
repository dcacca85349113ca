"""Checks of Lab 03's FSDP exercises: a unit built piece by piece (3.5-3.8).

:mod:`course_lib.fsdp.unit` wires the student's pieces into a working unit: 3.5
flattening and sharding is checked in the notebook's process on many shapes;
3.6 (the all-gather / reduce-scatter autograd Function) and 3.7 (saved-tensor
hooks that free the full parameters between forward and backward) train the
course GPT, one unit per block plus the root, under torchrun at world sizes 2
and 3 against one process on the whole batch, and read the collectives from
the counters; 3.8 (which units to prefetch) is checked against the library's
plan on many cases.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.grading import checks
from course_lib.models import GPT, GPTConfig

UNIT_CFG = GPTConfig(vocab=37, dim=22, layers=2, heads=2, seq_len=8)  # no unit divides by 2 or 3
UNIT_ROWS, UNIT_STEPS, UNIT_LR = 2, 2, 1e-2


def check_flatten_and_shard(flatten_and_shard, trials=60):
    ex = "Exercise 3.5"
    with checks.in_process(ex, flatten_and_shard):
        rng = random.Random(4)
        cases = [[(5, 1), (2,)], [(3, 3)], [(1,)], [(2, 3), (4,), (1, 1)]]
        cases += [[tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 2)))
                   for _ in range(rng.randint(1, 4))] for _ in range(trials)]
        for i, shapes in enumerate(cases):
            world = [3, 3, 4, 2][i] if i < 4 else rng.randint(1, 5)
            tensors = [torch.randn(shape, generator=torch.Generator().manual_seed(i))
                       for shape in shapes]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            padded = max(-(-flat.numel() // world) * world, world)
            want = torch.cat([flat, torch.zeros(padded - flat.numel())])
            size = padded // world
            what = f"flatten_and_shard(tensors of shapes {shapes}, rank, world={world})"
            for rank in range(world):
                got = flatten_and_shard(tensors, rank, world)
                if not (isinstance(got, tuple) and len(got) == 2):
                    raise checks.CheckFailed(f"{ex}: {what} should return (shard, padded), "
                                             f"got {type(got).__name__}")
                shard, got_padded = got
                checks.expect_equal(ex, got_padded, padded, rank=rank, world_size=world,
                                    what=f"{what}: padded size",
                                    hint="pad psi up to the next multiple of world (and to at "
                                         "least world: one element per rank)")
                checks.expect_close(ex, shard, want[rank * size:(rank + 1) * size], rank=rank,
                                    world_size=world, what=f"{what}: the shard",
                                    hint=f"rank r keeps [r*s, (r+1)*s) of the padded buffer, "
                                         f"s = padded/world = {size}; the padding is zeros at "
                                         f"the end")
                if shard.untyped_storage().nbytes() > shard.numel() * shard.element_size():
                    raise checks.CheckFailed(
                        f"{ex}: {what}: rank {rank}'s shard is a view of a larger buffer "
                        f"({shard.untyped_storage().nbytes()} bytes for {shard.numel()} "
                        f"elements), so every rank would still hold the whole unit.\nHint: "
                        f".clone() the slice so the full buffer can be freed.")
    checks.passed(ex, f"{len(cases)} units, every rank, padding and memory")


def _unit_job(piece, fn):
    """Train the GPT with every block (and the root) a ShardedUnit using the student's
    ``piece`` ("gather": 3.6, no resharding; "hooks": 3.7, full sharding)."""
    from course_lib import comm
    from course_lib.fsdp.unit import ShardedUnit, full_state_dict, original_name, shard_model
    from course_lib.models import Block

    rank, world = dist.get_rank(), dist.get_world_size()
    if piece == "gather":
        model = shard_model(GPT(UNIT_CFG), (Block,), reshard_after_forward=False,
                            gather=getattr(fn, "apply", fn))
    else:
        model = shard_model(GPT(UNIT_CFG), (Block,), hooks=fn)
    units = [(name, u) for name, u in model.named_modules() if isinstance(u, ShardedUnit)]
    layout = [[original_name(f"{name}.{p}" if name else p) for p in u.names] for name, u in units]
    opt = torch.optim.AdamW(model.parameters(), lr=UNIT_LR)
    x, y = _unit_batch(world)
    mine = slice(rank * UNIT_ROWS, (rank + 1) * UNIT_ROWS)
    first, whole_after_forward = None, []
    with comm.counting() as stats:
        for _ in range(UNIT_STEPS):
            opt.zero_grad()
            loss = F.cross_entropy(model(x[mine]).reshape(-1, UNIT_CFG.vocab), y[mine].reshape(-1))
            whole_after_forward.append([name or "root" for name, u in units if u.unsharded])
            loss.backward()
            if first is None:
                first = [u.shard.grad.clone() for _, u in units]
            opt.step()
    return (full_state_dict(model), first, layout, [u.padded for _, u in units], stats.as_dict(),
            whole_after_forward)


def _unit_batch(world):
    gen = torch.Generator().manual_seed(7)
    shape = (UNIT_ROWS * world, UNIT_CFG.seq_len)
    return (torch.randint(0, UNIT_CFG.vocab, shape, generator=gen),
            torch.randint(0, UNIT_CFG.vocab, shape, generator=gen))


def _unit_reference(world):
    """(first-step gradients by name, state after UNIT_STEPS) of one process, whole batch."""
    model = GPT(UNIT_CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=UNIT_LR)
    x, y = _unit_batch(world)
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
            checks.expect_close(ex, got_state[name], tensor, rank=rank, world_size=world,
                                rtol=1e-5, atol=2e-5, what=f"{name} after {UNIT_STEPS} AdamW steps",
                                hint=hint)


def check_gather_shards(gather_shards, world_sizes=(2, 3)):
    ex = "Exercise 3.6"
    for n in world_sizes:
        outs = checks.launch(ex, _unit_job, "gather", gather_shards, nproc=n, timeout=90)
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
    checks.passed(ex, f"world sizes {list(world_sizes)}, gradients and {UNIT_STEPS} AdamW steps "
                      f"as one process, one all-gather and one reduce-scatter per unit and step")


def _probe_hooks(ex, free_between_passes):
    """In this process: pack must not keep the full buffer; unpack must gather it again."""
    full = torch.arange(12.0)
    gathered = []

    def regather():
        if full.untyped_storage().nbytes() == 0:
            full.untyped_storage().resize_(12 * full.element_size())
            full.copy_(torch.arange(12.0))
            gathered.append(True)

    pack, unpack = free_between_passes(full, regather)
    view, other = full[2:8].view(2, 3).t(), torch.ones(3)
    packed = pack(view)
    if isinstance(packed, torch.Tensor) and \
            packed.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
        raise checks.CheckFailed(f"{ex}: pack returned the view of the full parameters itself, "
                                 f"so autograd keeps them alive until backward.\nHint: pack "
                                 f"a view of `full` as (offset, size, stride) instead.")
    kept = [t for t in _tensors_in(packed) if t.numel() * t.element_size() >= view.nbytes]
    if kept:
        raise checks.CheckFailed(f"{ex}: pack kept a tensor as large as the view ({kept[0].numel()} "
                                 f"elements), a copy of the parameters: freeing `full` then "
                                 f"saves nothing.\nHint: keep only where the view lies in "
                                 f"`full` (offset, size, stride) and rebuild it in unpack.")
    full.untyped_storage().resize_(0)  # what the unit does after forward
    try:
        back = unpack(packed)
    except Exception as exc:  # noqa: BLE001 - reported to the student below
        back = exc
    if not gathered:
        raise checks.CheckFailed(f"{ex}: unpack did not call regather() for a view of the full "
                                 f"parameters, which were freed after forward.\nHint: call "
                                 f"regather() first, then rebuild the view from `full`.")
    if isinstance(back, Exception):
        raise checks.CheckFailed(f"{ex}: unpack(pack(a view of full)) raised "
                                 f"{type(back).__name__}: {back}")
    if not (isinstance(back, torch.Tensor) and back.shape == view.shape and
            torch.equal(back, torch.arange(12.0)[2:8].view(2, 3).t())):
        raise checks.CheckFailed(f"{ex}: unpack(pack(full[2:8].view(2, 3).t())) gave "
                                 f"{back!r}, not that view.\nHint: "
                                 f"full.detach().as_strided(size, stride, offset)")
    if not torch.equal(unpack(pack(other)), other):
        raise checks.CheckFailed(f"{ex}: a tensor that is not a view of the full parameters "
                                 f"(an activation) must come back unchanged from pack/unpack.")


def _tensors_in(packed, depth=3):
    """The tensors inside what pack returned (a tensor, or containers of them)."""
    if isinstance(packed, torch.Tensor):
        return [packed]
    if depth and isinstance(packed, (tuple, list)):
        return [t for item in packed for t in _tensors_in(item, depth - 1)]
    if depth and isinstance(packed, dict):
        return [t for item in packed.values() for t in _tensors_in(item, depth - 1)]
    return []


def check_free_between_passes(free_between_passes, world_sizes=(2, 3)):
    ex = "Exercise 3.7"
    with checks.in_process(ex, free_between_passes):
        _probe_hooks(ex, free_between_passes)
    for n in world_sizes:
        outs = checks.launch(ex, _unit_job, "hooks", free_between_passes, nproc=n, timeout=90)
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
    checks.passed(ex, f"world sizes {list(world_sizes)}: freed between forward and backward, "
                      f"gathered again once, trained as one process")


def check_prefetch_plan(units_to_prefetch, trials=200):
    ex = "Exercise 3.8"
    from course_lib.fsdp import prefetch_targets

    with checks.in_process(ex, units_to_prefetch):
        rng = random.Random(5)
        cases = [(5, 1, 1, False), (5, 3, 1, True), (5, 4, 2, False), (5, 1, 2, True),
                 (4, 0, 1, True), (4, 3, 1, False)]
        cases += [(k, rng.randrange(k), rng.randint(0, 3), rng.random() < 0.5)
                  for k in (rng.randint(1, 8) for _ in range(trials))]
        for units, at, depth, backward in cases:
            order = [""] + [f"blocks.{i}" for i in range(units - 1)]
            want = prefetch_targets(order, order[at], depth, backward)
            got = list(units_to_prefetch(order, order[at], depth, backward))
            hint = ("in backward the units run in reverse: the next ones are those before the "
                    "current unit in the forward order, nearest first" if backward else
                    "in forward the next units are those after the current one")
            if got and sorted(got) == sorted(want) and got != want:
                hint = "the nearest unit computes first: start its all-gather first"
            checks.expect_equal(ex, got, want, rank=0, world_size=1,
                                what=f"units_to_prefetch({order}, {order[at]!r}, depth={depth}, "
                                     f"backward={backward})", hint=hint)
    checks.passed(ex, f"{len(cases)} cases, forward and backward")
