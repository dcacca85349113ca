"""What the checks of Lab 03's FSDP exercises run in the student's process or on its
ranks: the student's pieces on deterministic inputs, reported as plain facts. Nothing
here compares: the checks do, with references of their own."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.grading import wire
from course_lib.grading.requests import call_each
from course_lib.fsdp.unit import ShardedUnit, full_state_dict, original_name, shard_model
from course_lib.models import GPT, Block, GPTConfig

UNIT_CFG = GPTConfig(vocab=37, dim=22, layers=2, heads=2, seq_len=8)  # no unit divides by 2 or 3
UNIT_ROWS, UNIT_STEPS, UNIT_LR = 2, 2, 1e-2


def unit_optimizer(params):
    """AdamW for the unit's run and its reference. Its first step moves every weight by
    about lr * g / (|g| + eps): with torch's eps of 1e-8 a gradient that is 0 but for
    rounding (the reduce-scatter sums in another order than one process) moves its
    weight by +-lr, whichever way the rounding fell; an eps of 1e-6 keeps such a step at
    lr * 1e-4 of what a real gradient gets."""
    return torch.optim.AdamW(params, lr=UNIT_LR, eps=1e-6)


def _tensor_fact(value):
    """A tensor as plain data, or what the value was instead."""
    if isinstance(value, torch.Tensor):
        return {"tensor": value.detach().clone().as_subclass(torch.Tensor)}
    return {"type": type(value).__name__, "repr": repr(value)[:500]}


def _number_fact(value):
    return value if type(value) in (int, float, bool) or isinstance(value, torch.Tensor) \
        else repr(value)[:200]


def shard_facts(flatten_and_shard, cases):
    """Exercise 3.5: for each (tensors, world) of ``cases``, each rank's answer: its
    shard, padded size and the bytes of the shard's storage (``{"type": ...}`` for an
    answer that is not a pair, after which the case's other ranks are not asked)."""
    out = []
    for tensors, world in cases:
        ranks = []
        for rank in range(world):
            got = flatten_and_shard(tensors, rank, world)
            if not (isinstance(got, tuple) and len(got) == 2):
                ranks.append({"type": type(got).__name__})
                break
            shard, padded = got
            ranks.append({"shard": _tensor_fact(shard), "padded": _number_fact(padded),
                          "storage": shard.untyped_storage().nbytes()
                          if isinstance(shard, torch.Tensor) else None})
        out.append(ranks)
    return out


def unit_job(piece, fn):
    """Train the GPT with every block (and the root) a ShardedUnit using the student's
    ``piece`` ("gather": 3.6, no resharding; "hooks": 3.7, full sharding)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if piece == "gather":
        model = shard_model(GPT(UNIT_CFG), (Block,), reshard_after_forward=False,
                            gather=getattr(fn, "apply", fn))
    else:
        model = shard_model(GPT(UNIT_CFG), (Block,), hooks=fn)
    units = [(name, u) for name, u in model.named_modules() if isinstance(u, ShardedUnit)]
    layout = [[original_name(f"{name}.{p}" if name else p) for p in u.names] for name, u in units]
    opt = unit_optimizer(model.parameters())
    x, y = unit_batch(world)
    mine = slice(rank * UNIT_ROWS, (rank + 1) * UNIT_ROWS)
    first, whole_after_forward = None, []
    with wire.counting() as stats:
        for _ in range(UNIT_STEPS):
            opt.zero_grad()
            loss = F.cross_entropy(model(x[mine]).reshape(-1, UNIT_CFG.vocab), y[mine].reshape(-1))
            whole_after_forward.append([name or "root" for name, u in units if u.unsharded])
            loss.backward()
            if first is None:
                first = [u.shard.grad.clone() for _, u in units]
            opt.step()
    return (dict(full_state_dict(model)), first, layout, [u.padded for _, u in units],
            stats.as_dict(), whole_after_forward)


def unit_batch(world):
    gen = torch.Generator(device="cpu").manual_seed(7)
    shape = (UNIT_ROWS * world, UNIT_CFG.seq_len)
    return (torch.randint(0, UNIT_CFG.vocab, shape, generator=gen, device="cpu"),
            torch.randint(0, UNIT_CFG.vocab, shape, generator=gen, device="cpu"))


def probe_hooks(free_between_passes):
    """Exercise 3.7, in the student's process: pack/unpack on a view of a 12-element
    ``full`` and on another tensor, as facts (up to the first one that fails)."""
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
    facts = {"packed_full": isinstance(packed, torch.Tensor) and
             packed.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()}
    if facts["packed_full"]:
        return facts
    kept = [t for t in _tensors_in(packed) if t.numel() * t.element_size() >= view.nbytes]
    facts["kept"] = kept[0].numel() if kept else None
    if kept:
        return facts
    full.untyped_storage().resize_(0)  # what the unit does after forward
    try:
        back = unpack(packed)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported to the student by the check
        facts["unpack_raised"] = [type(exc).__name__, str(exc)[:500]]
    facts["gathered"] = bool(gathered)
    if not gathered or "unpack_raised" in facts:
        return facts
    facts["back"] = _tensor_fact(back)
    facts["other"] = _tensor_fact(unpack(pack(other)))
    return facts


def _tensors_in(packed, depth=3):
    """The tensors inside what pack returned (a tensor, or containers of them)."""
    if isinstance(packed, torch.Tensor):
        return [packed]
    if depth and isinstance(packed, (tuple, list)):
        return [t for item in packed for t in _tensors_in(item, depth - 1)]
    if depth and isinstance(packed, dict):
        return [t for item in packed.values() for t in _tensors_in(item, depth - 1)]
    return []


def prefetch_plans(units_to_prefetch, calls):
    """Exercise 3.8: :func:`~course_lib.grading.requests.call_each` of the student's
    function, each answer made a list."""
    return call_each(lambda *args: list(units_to_prefetch(*args)), calls)
