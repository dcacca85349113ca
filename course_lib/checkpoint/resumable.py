"""A training run that survives a killed rank (Lab 08): FSDP, AdamW, dropout drawn from
every rank's own generator, shuffled data, a checkpoint every few steps, and torchrun
bringing every rank back after a failure (``run(..., max_restarts=N)``).

``train`` is the same function for the uninterrupted run and the interrupted one; the
interrupted one is told which rank dies at which step of its first attempt::

    clean = run(train, root_a, 12, save_every=4, nproc=2)
    hit = run(train, root_b, 12, save_every=4, kill=(1, 6), nproc=2, max_restarts=1)
    hit[0]["losses"] == clean[0]["losses"]        # bit for bit (what the lab checks)

What each attempt does: seed this rank's generator (seed + rank), build the model, then
:func:`~course_lib.checkpoint.resume.resume_latest`, which finds the newest committed
checkpoint and overwrites the parameters, Adam's state, the generators and the data
position with what was saved; then train from the step saved. A rank told to die
writes the time to ``killed_at`` and sends itself SIGKILL: no clean-up, no message,
as a lost node would.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.checkpoint.resume import (DataCursor, restore_training_state, resume_latest,
                                          training_state)
from course_lib.checkpoint.save import save

KILLED_AT = "killed_at"  # the time the victim died: the clock for the time to resume
STEP_LOG = "steps.log"  # rank 0's steps, every attempt's: what the lab's timeline draws


def add_dropout(model, p):
    """Dropout on the residual stream entering each block, so that every step draws from
    the rank's generator (the GPT of the course has none of its own)."""
    for block in model.blocks:
        block.register_forward_pre_hook(
            lambda module, args: (F.dropout(args[0], p, training=module.training),))
    return model


def setup(cfg, seed=0, dropout=0.1, lr=3e-3, batch=4, group=None):
    """(model, optimizer, cursor) of a fresh start: the GPT under our FSDP with dropout,
    AdamW, and this rank's cursor over the course corpus."""
    from course_lib.data import char_corpus
    from course_lib.fsdp import FSDP, by_type
    from course_lib.models import GPT, Block

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = FSDP(add_dropout(GPT(cfg, seed=seed), dropout), units=by_type(Block),
                 group=group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    inputs, targets, _ = char_corpus(cfg.seq_len)
    cursor = DataCursor(inputs, targets, batch, rank, world, seed=seed)
    return model, optimizer, cursor


def one_step(model, optimizer, cursor, vocab, group=None):
    """One training step on this rank's next batch; the loss averaged over the ranks."""
    device = next(model.parameters()).device  # the corpus lives on the CPU
    x, y = (t.to(device) for t in cursor.next())
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
    loss.backward()
    optimizer.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=group)  # every rank reports the same number
    return (mean / dist.get_world_size(group)).item()


def train(root, steps, save_every=4, kill=None, cfg=None, seed=0, dropout=0.1, lr=3e-3,
          batch=4, group=None, capture=training_state, restore=restore_training_state):
    """Train to ``steps`` steps, saving under ``root`` after every ``save_every``th, and
    resume from the newest checkpoint there first. ``kill=(rank, step)``: in the first
    attempt, that rank dies in the middle of that step (after its forward). Returns
    ``{"losses": every step's mean loss, from step 0, "attempt": this attempt's number,
    "resumed_from": the step it started at, "resumed_after_s": seconds from the kill to
    the end of the first step this attempt ran (None if it did not resume from a kill)}``.
    ``capture`` and ``restore``: what is saved and put back (Exercise 8.5's, or the
    library's :func:`~course_lib.checkpoint.resume.training_state` and
    :func:`~course_lib.checkpoint.resume.restore_training_state`).
    """
    from course_lib.pipeline.runs import corpus_config

    cfg = cfg or corpus_config(layers=2, dim=32, heads=2, seq_len=16)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rank, attempt = dist.get_rank(group), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    torch.manual_seed(seed + rank)  # each rank's own stream of dropout masks
    model, optimizer, cursor = setup(cfg, seed, dropout, lr, batch, group)
    progress = {"losses": []}
    start = resume_latest(root, model, optimizer, cursor, group, progress, capture, restore)
    losses, resumed_after = list(progress["losses"]), None
    for step in range(start, steps):
        began = time.time()
        if kill is not None and attempt == 0 and (rank, step) == tuple(kill):
            x, _ = cursor.next()
            model(x.to(next(model.parameters()).device))  # mid-step: activations made, nothing saved since the last checkpoint
            (root / KILLED_AT).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        losses.append(one_step(model, optimizer, cursor, cfg.vocab, group))
        if rank == 0:
            with open(root / STEP_LOG, "a") as log:
                log.write(f"{attempt} {step} {began!r} {time.time()!r}\n")
        if resumed_after is None and step == start and (root / KILLED_AT).exists():
            resumed_after = time.time() - float((root / KILLED_AT).read_text())
        if (step + 1) % save_every == 0:
            state = capture(model, optimizer, cursor, step + 1, group)
            state["losses"] = losses
            save(state, root / f"step_{step + 1:06d}", group)
    return {"losses": losses, "attempt": attempt, "resumed_from": start,
            "resumed_after_s": resumed_after}


def step_log(root):
    """Rank 0's steps under ``root``, every attempt's, in order: [{"attempt", "step",
    "start", "end"}] (wall-clock seconds), and the time the victim died (None if none)."""
    root = Path(root)
    rows = []
    if (root / STEP_LOG).exists():
        for line in (root / STEP_LOG).read_text().split("\n"):
            if line:
                attempt, step, start, end = line.split()
                rows.append({"attempt": int(attempt), "step": int(step), "start": float(start),
                             "end": float(end)})
    killed = float((root / KILLED_AT).read_text()) if (root / KILLED_AT).exists() else None
    return rows, killed


__all__ = ["train", "setup", "one_step", "add_dropout", "step_log", "KILLED_AT"]
