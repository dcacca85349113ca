"""Exercise 8.4, a resharding load: the student's ``fill_box(path, entry, destination,
box)`` fills one box of a tensor from the pieces a checkpoint saved (their overlaps, read
as byte runs), and ``course_lib.checkpoint.load`` calls it for every box of a state.

One job on 4 of the student's ranks: the tiny GPT trained under FSDP on all 4 is saved
by the library (flat ranges of the units' shards, several pieces per rank and file), and
the student's load fills the state of three other layouts inside the same job, each on a
group that is not the world: tensor parallelism on ranks {0, 1}, FSDP on {0, 1, 2}
(other flat ranges, uneven) and one process on {3}; the job answers with the boxes. The
reference is the judge's own job on its own ranks (never the student's code): the same
training saved through torch.distributed.checkpoint (DCP), whose load fills the same
boxes. The verdict, here: every box equal to DCP's bit for bit, none left unfilled, and
the bytes ``fill_box`` says it read equal to the bytes of the boxes it filled.
"""
from __future__ import annotations

import functools

import torch.distributed as dist

from course_lib.checkpoint import load
from course_lib.checkpoint.reshard import compare_boxes, dcp_boxes_of, loaded_boxes, train_and_save

from course_lib.grading import checks, salt
from course_lib.grading.lab08.resume import _remove, _shared_folder
from course_lib.grading.requests import on_ranks

EX_LOAD = "Exercise 8.4"
LAYOUTS = (("tp", (0, 1)), ("fsdp", (0, 1, 2)), ("plain", (3,)))

__all__ = ["check_resharding_load", "resharding_job"]


def resharding_job(fill_box):
    """On every rank of the student's job: {layout: {"boxes": {name: [boxes]}, "read":
    bytes fill_box said it read, "wanted": bytes of the boxes}} for its layouts."""
    root, rank = _shared_folder(), dist.get_rank()
    train_and_save(root, after=0, with_dcp=False)
    groups = {layout: dist.new_group(list(members)) for layout, members in LAYOUTS}
    student_load = functools.partial(load, fill=fill_box)
    out = {}
    for layout, members in LAYOUTS:
        if rank in members:
            boxes, read, wanted = loaded_boxes(root, layout, student_load, groups[layout])
            out[layout] = {"boxes": boxes, "read": read, "wanted": wanted}
    _remove(root)
    return out


def dcp_job():
    """On every rank of the judge's job: {layout: {name: [boxes DCP filled]}}."""
    root, rank = _shared_folder(), dist.get_rank()
    train_and_save(root, after=0)
    groups = {layout: dist.new_group(list(members)) for layout, members in LAYOUTS}
    out = {layout: dcp_boxes_of(root, layout, groups[layout])
           for layout, members in LAYOUTS if rank in members}
    _remove(root)
    return out


@checks.check(EX_LOAD, hidden=salt.draw)
def check_resharding_load(fill_box):
    ex = EX_LOAD
    try:
        outs = yield on_ranks(resharding_job, fill_box, nproc=4, timeout=180)
    except checks.CheckFailed as exc:
        if "must match the size" not in str(exc) and "out of bounds" not in str(exc):
            raise
        failed = checks.CheckFailed(
            f"{exc}\nHint: destination holds the box only, not the whole tensor: write the "
            f"overlap at its offsets minus the box's offsets.", exercise=ex)
        failed.stacks = getattr(exc, "stacks", None)
        raise failed from None
    references = checks.reference_ranks(dcp_job, nproc=4, timeout=180)
    for layout, members in LAYOUTS:
        for rank in members:
            got = outs[rank][layout]
            _, differ, unfilled = compare_boxes(got["boxes"], references[rank][layout])
            got = {**got, "differ": differ, "unfilled": unfilled}
            where = f"loading into {_name(layout, members)}, on rank {rank}"
            if got["unfilled"]:
                raise checks.CheckFailed(
                    f"{ex}: {where}, boxes were left unfilled: {_few(got['unfilled'])}. Every "
                    f"saved piece that overlaps the box gives part of it: go through all the "
                    f"pieces of entry['pieces'], not only the first that overlaps.")
            if got["differ"]:
                raise checks.CheckFailed(
                    f"{ex}: {where}, boxes differ from what DCP loads from the same state: "
                    f"{_few(got['differ'])}. Read each run at piece['byte_offset'] + its "
                    f"offset in the piece's file (a rank's file holds all its pieces, one after "
                    f"the other), and write the overlap into destination at the overlap's "
                    f"offsets minus the box's (destination holds the box, not the whole tensor).")
            if got["read"] != got["wanted"]:
                raise checks.CheckFailed(
                    f"{ex}: {where}, your fill_box calls returned {got['read']} bytes read in all, "
                    f"but the boxes hold {got['wanted']} bytes: return the bytes you read, and "
                    f"read only the runs of each overlap.")
    return ("the GPT and AdamW saved from FSDP on 4 ranks, loaded into TP on 2, FSDP on 3 "
            "and one process (groups that are not the world): every box equal to DCP's")


def _name(layout, members):
    what = {"tp": "tensor parallelism", "fsdp": "FSDP", "plain": "one process"}[layout]
    return f"{what} on ranks {list(members)}" if len(members) > 1 else what


def _few(names):
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
