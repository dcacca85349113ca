"""Exercise 8.5, an exact resume: the student's ``training_state`` (what to save besides
the model) and ``restore_training_state`` (what to put back by hand after the load).

Three jobs of 3 ranks, each rank with its own dropout generator. The reference, run by
the check's own process (the judge: no student code): six steps, uninterrupted, and
what the state was after three. Then, on the student's side, a job trains three steps
and saves with the student's ``training_state``; a *fresh* job (new processes: nothing
survives in memory, as after a real failure) builds the model, optimizer, data cursor
and a generator in another state, resumes from the checkpoint with the student's two
functions and runs steps 3-5. The verdict is the losses: those of the resumed steps
must equal the reference's, bit for bit. What the resumed job reports (was each rank's
generator, data position, optimizer state back as the reference had it?) only chooses
the hint. The real thing, a rank SIGKILLed and torchrun restarting every rank, is the
lab's demonstration with the same two functions
(:func:`course_lib.checkpoint.resumable.train`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.checkpoint.resumable import one_step, setup
from course_lib.checkpoint.resume import resume_latest
from course_lib.checkpoint.save import save
from course_lib.pipeline.runs import corpus_config

from course_lib.grading import checks, salt
from course_lib.grading.requests import on_ranks

EX_RESUME = "Exercise 8.5"
STEPS, SAVED_AT, WORLD = 6, 3, 3

__all__ = ["check_exact_resume", "reference_job", "save_job", "resume_job"]


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


def _start(seed):
    """The model, optimizer and data cursor of a fresh process, its generator seeded."""
    cfg = corpus_config(layers=1, dim=16, heads=2, seq_len=8)
    torch.manual_seed(seed)
    return cfg, *setup(cfg, batch=2)


def _snapshot(model, optimizer, cursor):
    """What the next step depends on, to compare (the hints) as plain data."""
    return {"rng": torch.get_rng_state(), "data": cursor.position(),
            "optim": _optimizer_tensors(optimizer),
            "model": [p.detach().clone() for p in model.parameters()]}


def reference_job():
    """The judge's: every loss of the uninterrupted run, and the state after SAVED_AT."""
    cfg, model, optimizer, cursor = _start(dist.get_rank())  # dropout masks of its own
    losses = []
    for step in range(STEPS):
        if step == SAVED_AT:
            at_save = _snapshot(model, optimizer, cursor)
        losses.append(one_step(model, optimizer, cursor, cfg.vocab))
    return {"losses": losses, "at_save": at_save}


def save_job(training_state):
    """The student's side: SAVED_AT steps, then a save with the student's state, on the
    warm ranks (what a save leaves in memory is no help: the resume runs in new
    processes). The checkpoint goes beside the job's folder, which goes with the job."""
    beside = Path(os.environ.get("TMPDIR", tempfile.gettempdir())).parent
    name = [tempfile.mkdtemp(prefix="lab08-resume-", dir=beside) if dist.get_rank() == 0
            else None]
    dist.broadcast_object_list(name, group_src=0)
    root = Path(name[0])
    cfg, model, optimizer, cursor = _start(dist.get_rank())
    losses = [one_step(model, optimizer, cursor, cfg.vocab) for _ in range(SAVED_AT)]
    save(training_state(model, optimizer, cursor, SAVED_AT, None),
         root / f"step_{SAVED_AT:06d}")
    return {"losses": losses, "root": str(root)}


def resume_job(training_state, restore_training_state, root):
    """The student's side, in new processes: resume with the student's functions and run
    to the end; the losses, the step returned, and the state right after the resume."""
    root = Path(root)
    cfg, model, optimizer, cursor = _start(1000 + dist.get_rank())  # nothing as it was
    start = resume_latest(root, model, optimizer, cursor, None, None, training_state,
                          restore_training_state)
    after = _snapshot(model, optimizer, cursor)
    resumed = None
    if isinstance(start, int) and not isinstance(start, bool) and 0 <= start <= STEPS:
        resumed = [one_step(model, optimizer, cursor, cfg.vocab) for _ in range(start, STEPS)]
    else:
        start = repr(start)
    dist.barrier()  # (only on success: see _remove)
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"start": start, "resumed": resumed, "after": after}


@checks.check(EX_RESUME, hidden=salt.draw)
def check_exact_resume(training_state, restore_training_state):
    ex = EX_RESUME
    reference = checks.reference_ranks(reference_job, nproc=WORLD)
    saved = yield on_ranks(save_job, training_state, nproc=WORLD, timeout=120)
    if [out["losses"] for out in saved] != [r["losses"][:SAVED_AT] for r in reference]:
        raise checks.CheckFailed(f"{ex}: the first {SAVED_AT} steps, before any save, gave "
                                 f"other losses than the reference run: did your code change "
                                 f"the training itself?")
    outs = yield on_ranks(resume_job, training_state, restore_training_state, saved[0]["root"],
                          nproc=WORLD, timeout=120, fresh=True)
    for rank, out in enumerate(outs):
        if out["start"] != SAVED_AT:
            raise checks.CheckFailed(
                f"{ex}: after the load, restore_training_state returned {out['start']} on rank "
                f"{rank}; the checkpoint was taken after {SAVED_AT} steps, so the run must go on "
                f"at step {SAVED_AT}: return the step the state holds once it is loaded")
    # the loss is averaged over the ranks: one rank's wrong state shows on every rank
    want, got = reference[0]["losses"][SAVED_AT:], outs[0]["resumed"]
    if got != want:
        first = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w) + SAVED_AT
        raise checks.CheckFailed(
            f"{ex}: the resumed run's loss (the mean over the {WORLD} ranks) at step {first} "
            f"is {got[first - SAVED_AT]!r}, the uninterrupted run's {want[first - SAVED_AT]!r}; "
            f"they must be equal to the last bit. {_hint(outs, reference)}")
    return (f"{WORLD} ranks, dropout from a generator per rank, AdamW, shuffled data: saved "
            f"after {SAVED_AT} steps, resumed in new processes, steps {SAVED_AT}-{STEPS - 1} "
            f"(from 0) equal to the uninterrupted run bit for bit")


def _hint(outs, reference):
    def back(rank, part):
        got, want = outs[rank]["after"][part], reference[rank]["at_save"][part]
        if part == "data":
            return got == want
        if part == "rng":
            return torch.equal(got, want)
        return _same(got, want)

    def everywhere(part):
        return all(back(rank, part) for rank in range(len(outs)))

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
        if back(0, "rng"):
            return ("Rank 0's generator came back but not the other ranks': a plain tensor "
                    "is saved once, by rank 0, and every rank loads rank 0's state. Each "
                    "rank's generator is its own: save it as row `rank` of a ShardedTensor "
                    "of shape (world, n).")
        return ("The generator was not back in the state it had at the save, so dropout "
                "draws other masks: save torch.get_rng_state() on every rank (one row per "
                "rank) and torch.set_rng_state(...) it after the load.")
    return ("The model, the optimizer, the data position and the generators all came back: "
            "is something else the step depends on (a learning rate you changed?) missing?")
