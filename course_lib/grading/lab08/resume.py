"""Exercise 8.5, an exact resume: the student's ``training_state`` (what to save besides
the model) and ``restore_training_state`` (what to put back by hand after the load).

The job (on 3 ranks, each with its own dropout generator) trains six steps, saving
after the third with the student's ``training_state``; then it starts again as a
restarted process would, from a fresh model, optimizer, data cursor and a generator in
another state, resumes from the checkpoint with the student's two functions and runs
to step six. The verdict is the losses: those of the resumed steps must equal the
uninterrupted run's, bit for bit. What the job also reports (was each rank's
generator, data position, optimizer state back as it was at the save?) only chooses
the hint. The real thing, a rank SIGKILLed and torchrun restarting every rank, is the
lab's demonstration with the same two functions
(:func:`course_lib.checkpoint.resumable.train`).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.grading import checks
from course_lib.grading.requests import on_ranks

EX_RESUME = "Exercise 8.5"
STEPS, SAVED_AT, WORLD = 6, 3, 3

__all__ = ["check_exact_resume", "resume_job"]


def _shared_folder():
    """A folder every rank of the job sees (rank 0 makes it, the others hear its name).
    It lies in the job's temporary folder (the launcher's TMPDIR), which goes with the job."""
    name = [tempfile.mkdtemp(prefix="lab08-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, group_src=0)
    return Path(name[0])


def _remove(root):
    """After every rank is done with ``root``. Only on success: a rank whose student code
    raised must not wait in a barrier its peers, stuck in a collective, never reach (its
    error would turn into a hang); the job's folder, and ``root`` in it, goes anyway."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


def _optimizer_tensors(optimizer):
    return [t.clone() for state in optimizer.state.values() for t in state.values()
            if isinstance(t, torch.Tensor)]


def _same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def resume_job(training_state, restore_training_state):
    """On every rank: the uninterrupted losses, the step the resume returned, the resumed
    losses, and which parts of the state came back as they were at the save."""
    from course_lib.checkpoint.resumable import one_step, setup
    from course_lib.checkpoint.resume import resume_latest
    from course_lib.checkpoint.save import save
    from course_lib.pipeline.runs import corpus_config

    cfg = corpus_config(layers=1, dim=16, heads=2, seq_len=8)
    rank, root = dist.get_rank(), _shared_folder()
    torch.manual_seed(rank)  # every rank draws dropout masks of its own
    model, optimizer, cursor = setup(cfg, batch=2)
    clean = []
    for step in range(STEPS):
        clean.append(one_step(model, optimizer, cursor, cfg.vocab))
        if step + 1 == SAVED_AT:
            save(training_state(model, optimizer, cursor, SAVED_AT, None),
                 root / f"step_{SAVED_AT:06d}")
            at_save = {"rng": torch.get_rng_state(), "data": cursor.position(),
                       "optim": _optimizer_tensors(optimizer),
                       "model": [p.detach().clone() for p in model.parameters()]}
    torch.manual_seed(1000 + rank)  # a restarted process: nothing as it was
    model, optimizer, cursor = setup(cfg, batch=2)
    start = resume_latest(root, model, optimizer, cursor, None, None, training_state,
                          restore_training_state)
    back = {"rng": torch.equal(torch.get_rng_state(), at_save["rng"]),
            "data": cursor.position() == at_save["data"],
            "optim": _same(_optimizer_tensors(optimizer), at_save["optim"]),
            "model": _same([p.detach() for p in model.parameters()], at_save["model"])}
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= STEPS:
        _remove(root)
        return {"clean": clean, "start": repr(start), "resumed": None, "back": back}
    resumed = [one_step(model, optimizer, cursor, cfg.vocab) for _ in range(start, STEPS)]
    _remove(root)
    return {"clean": clean, "start": start, "resumed": resumed, "back": back}


@checks.check(EX_RESUME)
def check_exact_resume(training_state, restore_training_state):
    ex = EX_RESUME
    outs = yield on_ranks(resume_job, training_state, restore_training_state, nproc=WORLD,
                          timeout=120)
    for rank, out in enumerate(outs):
        if out["start"] != SAVED_AT:
            raise checks.CheckFailed(
                f"{ex}: after the load, restore_training_state returned {out['start']} on rank "
                f"{rank}; the checkpoint was taken after {SAVED_AT} steps, so the run must go on "
                f"at step {SAVED_AT}: return the step the state holds once it is loaded")
    # the loss is averaged over the ranks: one rank's wrong state shows on every rank
    want, got = outs[0]["clean"][SAVED_AT:], outs[0]["resumed"]
    if got != want:
        first = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w) + SAVED_AT
        raise checks.CheckFailed(
            f"{ex}: the resumed run's loss (the mean over the {WORLD} ranks) at step {first} "
            f"is {got[first - SAVED_AT]!r}, the uninterrupted run's {want[first - SAVED_AT]!r}; "
            f"they must be equal to the last bit. {_hint(outs)}")
    return (f"{WORLD} ranks, dropout from a generator per rank, AdamW, shuffled data: saved "
            f"after {SAVED_AT} steps, resumed in a fresh start, steps {SAVED_AT}-{STEPS - 1} "
            f"(from 0) equal to the uninterrupted run bit for bit")


def _hint(outs):
    def everywhere(part):
        return all(out["back"][part] for out in outs)

    if not everywhere("model"):
        return ("The model's parameters were not back as they were at the save: the state "
                "must hold them (state_of(model, optimizer) gives the model and the optimizer).")
    if not everywhere("optim"):
        return ("AdamW's state was not back: its moments m and v (and its step count t, in "
                "the bias corrections 1 - beta^t) start again from zero. Save the optimizer "
                "with the model: state_of(model, optimizer).")
    if not everywhere("data"):
        return ("The data cursor was not where it was at the save: the resumed run reads "
                "other batches. Save cursor.position() and cursor.seek(...) it back.")
    if not everywhere("rng"):
        if outs[0]["back"]["rng"]:
            return ("Rank 0's generator came back but not the other ranks': a plain tensor "
                    "is saved once, by rank 0, and every rank loads rank 0's state. Each "
                    "rank's generator is its own: save it as row `rank` of a ShardedTensor "
                    "of shape (world, n).")
        return ("The generator was not back in the state it had at the save, so dropout "
                "draws other masks: save torch.get_rng_state() on every rank (one row per "
                "rank) and torch.set_rng_state(...) it after the load.")
    return ("The model, the optimizer, the data position and the generators all came back: "
            "is something else the step depends on (a learning rate you changed?) missing?")
