"""What an exact resume needs besides the model (Lab 08).

A run resumed from step s gives, bit for bit, the losses the uninterrupted run gave
from step s on only if every input of step s is what it was: the parameters, the
optimizer's state (Adam's moments m, v and its step count t, which sets the bias
corrections 1 - beta^t), the random numbers each rank would draw next (dropout's masks:
one generator *per rank*, each seeded differently), and the data each rank reads next
(where the shuffled epoch was). Miss any one and the losses drift apart from the step
it first matters:

- the model only: Adam restarts with m = v = 0 and t = 0: the first update is a
  sign-like step of size lr on every weight;
- rank 0's generator saved for everyone: every rank draws rank 0's masks;
- no data position: the resumed run reads the epoch from its start again.

:func:`training_state` gathers all of it into one state for
:func:`~course_lib.checkpoint.save` (the model and optimizer through
:func:`~course_lib.checkpoint.state.state_of`; a rank's generator state as row ``r``
of a ``(world, n)`` :class:`~course_lib.checkpoint.boxes.ShardedTensor`; the data
position and the step as plain values), :func:`restore_training_state` puts back what a
load cannot fill in place, and :func:`resume_latest` does the whole resume::

    cursor = DataCursor(inputs, targets, batch=8, rank=r, world=n, seed=0)
    step = resume_latest(root, model, opt, cursor, group)          # 0 if none yet
    ...
    save(training_state(model, opt, cursor, step, group), f"{root}/step_{step:06d}")
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.checkpoint.boxes import ShardedTensor
from course_lib.checkpoint.load import load
from course_lib.checkpoint.save import latest
from course_lib.checkpoint.state import ensure_optimizer_state, set_optimizer_step, state_of


class DataCursor:
    """Rank ``rank``'s place in a data set read in shuffled epochs.

    Epoch e's order is a permutation drawn from a generator seeded with (seed, e), the
    same on every rank; global batch i is rows [i B, (i + 1) B) of it, and rank r
    reads rows r, r + n, ... of that batch (B = ``batch`` * ``world``). The whole
    position is (epoch, batches taken in it): two integers restore it exactly.
    """

    def __init__(self, inputs, targets, batch, rank, world, seed=0):
        if len(inputs) < batch * world:
            raise ValueError(f"{len(inputs)} rows hold no global batch of {batch} x {world}")
        self.inputs, self.targets = inputs, targets
        self.batch, self.rank, self.world, self.seed = batch, rank, world, seed
        self.epoch, self.taken = 0, 0

    @property
    def per_epoch(self):
        return len(self.inputs) // (self.batch * self.world)  # the remainder is skipped

    def _order(self):
        gen = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.inputs), generator=gen, device="cpu")

    def next(self):
        """This rank's (x, y) of the next global batch."""
        if self.taken == self.per_epoch:
            self.epoch, self.taken = self.epoch + 1, 0
        width = self.batch * self.world
        rows = self._order()[self.taken * width:(self.taken + 1) * width][self.rank::self.world]
        self.taken += 1
        return self.inputs[rows], self.targets[rows]

    def position(self):
        return {"data.epoch": self.epoch, "data.taken": self.taken}

    def seek(self, position):
        self.epoch, self.taken = int(position["data.epoch"]), int(position["data.taken"])


def _generators():
    """{name: generator state} this rank draws from: the CPU's, and its GPU's if it has one."""
    from course_lib.runtime.backend import current_device

    states = {"rng.cpu": torch.get_rng_state()}
    # a GPU rank (NCCL) draws dropout on its GPU; decided by the rank's device, not by
    # whether CUDA happens to be initialised yet, so a save and its resume agree
    if current_device().type == "cuda":
        states["rng.cuda"] = torch.cuda.get_rng_state()
    return states


def rng_entries(group=None):
    """Each generator's state as row ``rank`` of a ``(world, n)`` uint8 tensor: one row per
    rank, because every rank's generator is in a state of its own."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    return {name: ShardedTensor(state.view(1, -1).clone(), (world, state.numel()), (rank, 0))
            for name, state in _generators().items()}


def set_rng(entries):
    """Put the loaded generator states back (after :func:`~course_lib.checkpoint.load`)."""
    torch.set_rng_state(entries["rng.cpu"].local[0].clone())
    if "rng.cuda" in entries:
        torch.cuda.set_rng_state(entries["rng.cuda"].local[0].clone())


def training_state(model, optimizer, cursor, step, group=None):
    """Everything step ``step`` (the next one to run) depends on, ready for ``save``:
    model and optimizer under the dense names, every rank's generators, the data
    position, the step."""
    state = state_of(model, optimizer)
    state.update(rng_entries(group))
    state.update(cursor.position())
    state["step"] = int(step)
    return state


def restore_training_state(state, cursor):
    """After ``load`` filled ``state`` (the model and the optimizer in place): what is not
    a view of a live tensor goes back by hand. Returns the step to run next."""
    set_rng(state)
    cursor.seek(state)
    return state["step"]


def resume_latest(root, model, optimizer, cursor, group=None, extra=None,
                  capture=training_state, restore=restore_training_state):
    """Load the newest committed checkpoint under ``root`` into the model, the optimizer,
    this rank's generators and ``cursor``; return the step to run next (0 and nothing
    touched if there is none). ``extra`` (a dict of plain values saved beside, the
    losses so far say) is updated with the saved ones. ``capture`` and ``restore`` are
    :func:`training_state` and :func:`restore_training_state` unless given (Lab 08's
    Exercise 8.5 hands its own)."""
    path = latest(root)
    if path is None:
        return 0
    ensure_optimizer_state(model, optimizer)
    state = capture(model, optimizer, cursor, 0, group)
    state.update(extra or {})
    load(state, path, group)
    set_optimizer_step(state, optimizer)
    if extra is not None:
        extra.update({k: state[k] for k in extra})
    return restore(state, cursor)


__all__ = ["DataCursor", "rng_entries", "set_rng", "training_state", "restore_training_state",
           "resume_latest"]
