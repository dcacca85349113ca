"""Lab 08's resharding run: the GPT trained under FSDP on one number of ranks, saved, and
loaded into another layout (tensor parallelism, FSDP on another count, one process),
with torch.distributed.checkpoint (DCP) loading the same state beside ours as the
reference. Every function runs on every rank of a job (``run(fn, ..., nproc=n)``);
``root`` is a folder all of them see.

    run(train_and_save, root, nproc=4)                  # ours and DCP's, same state
    run(continue_from, root / "ours", "tp", nproc=2)    # the next losses, as on 4
    run(compare_with_dcp, root, "tp", nproc=2)          # every box, bit for bit
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.checkpoint.boxes import ShardedTensor
from course_lib.checkpoint.dcp_reference import dcp_boxes, dense_state, empty_like_state, save_dense
from course_lib.checkpoint.load import load
from course_lib.checkpoint.save import save
from course_lib.checkpoint.state import ensure_optimizer_state, restore, state_of

LAYOUTS = ("plain", "fsdp", "tp")


def config():
    """A GPT whose 24 x 24 matrices split unevenly over 3 or 4 FSDP ranks."""
    from course_lib.pipeline.runs import corpus_config

    return corpus_config(layers=2, dim=24, heads=2, seq_len=8)


def build(layout, cfg=None, lr=1e-2, group=None):
    """(model, AdamW) of the GPT in ``layout`` over ``group`` (the world by default):
    "plain" (one process or replicated), "fsdp" (a unit per block) or "tp" (every
    block's layers split)."""
    from course_lib.fsdp import FSDP, by_type
    from course_lib.models import GPT, Block
    from course_lib.tp import parallelize_block

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    cfg = cfg or config()
    model = GPT(cfg, seed=0)
    if layout == "fsdp":
        model = FSDP(model, units=by_type(Block), group=group)
    elif layout == "tp":
        for block in model.blocks:
            parallelize_block(block, group or dist.group.WORLD)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _batches(cfg, steps):
    from course_lib.pipeline.runs import corpus_batches

    return list(corpus_batches(cfg, 2, steps, "cpu"))  # every rank the same batch


def _step(model, optimizer, x, y, vocab):
    from course_lib.pipeline.runs import gpt_loss

    optimizer.zero_grad(set_to_none=True)
    loss = gpt_loss(vocab)(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def train_and_save(root, steps=2, after=2, with_dcp=True):
    """Train ``steps`` AdamW steps under FSDP, save ours to ``root/ours`` (and the same
    state through DCP to ``root/dcp``), then ``after`` more steps. Returns {"bytes": what
    this rank wrote, "losses": the ``after`` losses that followed the save}."""
    cfg = config()
    model, optimizer = build("fsdp", cfg)
    batches = _batches(cfg, steps + after)
    for x, y in batches[:steps]:
        _step(model, optimizer, x, y, cfg.vocab)
    written = save(state_of(model, optimizer), root / "ours")
    if with_dcp:
        save_dense(dense_state(model, optimizer), root / "dcp")
    return {"bytes": written,
            "losses": [_step(model, optimizer, x, y, cfg.vocab) for x, y in batches[steps:]]}


def continue_from(path, layout, steps=2, after=2):
    """Load ours from ``path`` into ``layout`` and take the ``after`` steps that followed
    the save: {"bytes_read": this rank's reads, "losses": the losses}."""
    cfg = config()
    model, optimizer = build(layout, cfg)
    read = restore(path, model, optimizer)
    batches = _batches(cfg, steps + after)[steps:]
    return {"bytes_read": read,
            "losses": [_step(model, optimizer, x, y, cfg.vocab) for x, y in batches]}


def _pieces(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, ShardedTensor):
        return [value.local]
    return [v.local for v in value]


def loaded_boxes(root, layout="tp", load_fn=load, group=None):
    """``layout``'s state (over ``group``) filled from ``root/ours`` by ``load_fn``, every
    box starting as NaN: ({name: [this rank's boxes]}, what ``load_fn`` returned, the
    bytes of this rank's boxes)."""
    model, optimizer = build(layout, group=group)
    ensure_optimizer_state(model, optimizer)
    ours = state_of(model, optimizer)
    with torch.no_grad():
        for value in ours.values():
            for t in _pieces(value):
                t.fill_(float("nan"))
    read = load_fn(ours, root / "ours")
    wanted = sum(t.numel() * t.element_size() for v in ours.values() for t in _pieces(v))
    return {name: _pieces(value) for name, value in ours.items()}, read, wanted


def dcp_boxes_of(root, layout="tp", group=None):
    """The same boxes as :func:`loaded_boxes`, filled by DCP from ``root/dcp``."""
    model, optimizer = build(layout, group=group)
    ensure_optimizer_state(model, optimizer)
    theirs = empty_like_state(state_of(model, optimizer))
    dcp_boxes(root / "dcp", theirs, group)
    return {name: _pieces(value) for name, value in theirs.items()}


def compare_boxes(mine, reference):
    """(boxes per name, boxes that differ, boxes left NaN) of two {name: [boxes]}."""
    boxes, differ, unfilled = {}, [], []
    for name in mine:
        boxes[name] = len(mine[name])
        for i, (a, b) in enumerate(zip(mine[name], reference[name], strict=True)):
            if torch.isnan(a).any() or torch.isnan(b).any():
                unfilled.append(f"{name}[{i}]")
            elif not (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
                differ.append(f"{name}[{i}]")
    return boxes, differ, unfilled


def compare_with_dcp(root, layout="tp", load_fn=load, group=None):
    """Fill ``layout``'s state (over ``group``) from ``root/ours`` with ``load_fn`` (ours,
    or one with a student's ``fill``) and from ``root/dcp`` with DCP; every box starts as
    NaN. Returns {"boxes": {name: count}, "differ": boxes that differ, "unfilled": boxes
    still NaN, "read": what ``load_fn`` returned, "wanted": the bytes of this rank's boxes}."""
    mine, read, wanted = loaded_boxes(root, layout, load_fn, group)
    boxes, differ, unfilled = compare_boxes(mine, dcp_boxes_of(root, layout, group))
    return {"boxes": boxes, "differ": differ, "unfilled": unfilled, "read": read,
            "wanted": wanted}


__all__ = ["LAYOUTS", "config", "build", "train_and_save", "continue_from", "loaded_boxes",
           "dcp_boxes_of", "compare_boxes", "compare_with_dcp"]
