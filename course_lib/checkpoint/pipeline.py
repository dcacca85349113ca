"""Per-stage checkpoints (PipeDream, Lab 08): each pipeline stage saves its own layers
when it is ready, with no barrier across stages; a restart picks the newest step that
every stage committed.

Stage s of step t lives in ``root/step_<t>/stage_<s>``, a checkpoint of its own (its data,
index and commit marker). A stage that died while saving step t leaves step t incomplete,
and :func:`latest_complete` goes back to the newest step all stages finished::

    save_stage(stage_state, "ckpt", step=120, stage=s)
    step_dir = latest_complete("ckpt", n_stages=4)     # ckpt/step_000120, or an earlier one
    load_stages(state_of(new_stage, optimizer), step_dir)   # any partition, any stage count

A stage's state is under the whole model's names (``GPTStage`` keeps the GPT's own
parameter names, ``blocks.<i>`` with the global i), so a restart may cut the model
differently: each name is read from whichever stage saved it.
"""
from __future__ import annotations

import re
from pathlib import Path

from course_lib.checkpoint.files import CheckpointError, is_committed, read_index
from course_lib.checkpoint.load import load
from course_lib.checkpoint.save import save


def stage_path(root, step, stage):
    return Path(root) / f"step_{step:06d}" / f"stage_{stage:03d}"


def save_stage(state, root, step, stage):
    """This stage's state for ``step``, saved by this process alone; the bytes written."""
    return save(state, stage_path(root, step, stage), local=True)


def _step_dirs(root):
    """[(t, path)] of the ``step_<t>`` directories under ``root``, oldest first."""
    root = Path(root)
    found = [(re.fullmatch(r"step_(\d+)", child.name), child)
             for child in (root.iterdir() if root.is_dir() else []) if child.is_dir()]
    return sorted((int(match.group(1)), child) for match, child in found if match)


def _complete(step_dir, n_stages):
    return all(is_committed(step_dir / f"stage_{s:03d}") for s in range(n_stages))


def latest_complete(root, n_stages):
    """The newest ``step_*`` directory under ``root`` in which all ``n_stages`` stages
    committed, or None."""
    complete = [path for _, path in _step_dirs(root) if _complete(path, n_stages)]
    return complete[-1] if complete else None


def plan_restart(root, n_stages, keep=2):
    """What a restart does before its first save, as data: ``(resume, remove)``, the step
    directory to resume from (:func:`latest_complete`'s, or None) and the ``step_*``
    directories to delete. It keeps the ``keep`` newest complete steps (``keep`` >= 1) and
    nothing else: a step newer than ``resume`` was written by the run that died, and the
    resumed run will save that step again (a committed stage there would refuse the save,
    leftover files would mix two runs in one step); an incomplete step can never be
    loaded, and a complete one older than the ``keep`` newest only takes disk. Plan once
    every process of the old run has ended (as torchrun ends them on a failure)::

        resume, remove = plan_restart("ckpt", n_stages=4, keep=2)
        for path in remove:
            shutil.rmtree(path)
    """
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive number of checkpoints, got {keep!r}")
    steps = [path for _, path in _step_dirs(root)]
    kept = [path for path in steps if _complete(path, n_stages)][-keep:]
    return (kept[-1] if kept else None), [path for path in steps if path not in kept]


def load_stages(state, step_dir):
    """Fill ``state`` (``load``'s kind) from the stage checkpoints of ``step_dir``, each
    name from the stage that saved it; returns the bytes read. Raises if a name is in no
    stage. Plain values (the step) are taken from the first stage that holds them."""
    read, found = 0, set()
    for stage_dir in sorted(Path(step_dir).glob("stage_*")):
        index = read_index(stage_dir)
        names = [n for n in state if n not in found
                 and (n in index["tensors"] or n in index["values"])]
        part = {n: state[n] for n in names}
        read += load(part, stage_dir)
        state.update(part)
        found.update(names)
    missing = [n for n in state if n not in found]
    if missing:
        raise CheckpointError(f"{step_dir}: no stage saved {missing[:5]}"
                              f"{' and more' if len(missing) > 5 else ''}")
    return read
