"""Exercise 8.3, an atomic sharded save: the student's ``sharded_save(state, path, group)``,
course_lib.checkpoint.save's pieces (refuse_committed, layout, write_data, commit) in order.

The job saves a known state (uneven row boxes, a replicated float64 tensor, plain values)
with it on 3 ranks, then on ranks {1, 2} of 3 as a group. The disk is slow: every fsync
takes 50 ms more, group rank r's first one 0.5 r s more, so rank 2's data file lands
1 s after rank 0's, once every rank has begun. The job reports: was the checkpoint
committed when each rank's save returned; each file's size and when it appeared under
its name (st_ctime_ns: a rename sets it); the ranks the index describes; what
course_lib's load reads back (in columns, consolidated); what a second save into the
committed directory did. The verdict is all here. (A marker written early and again
after the index leaves no trace in the final files: not seen.)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.checkpoint.boxes import ShardedTensor
from course_lib.checkpoint.files import COMMITTED, INDEX, is_committed
from course_lib.checkpoint.load import consolidate, load
from course_lib.grading import checks
from course_lib.grading.requests import on_ranks

EX_ATOMIC = "Exercise 8.3"
ROWS, COLUMNS = {3: (3, 2, 4), 2: (3, 4)}, {3: (2, 2, 1), 2: (3, 2)}
WIDTH, LATE_S, FSYNC_S = 5, 0.5, 0.05
DATA = re.compile(r"rank\d{5}\.bin")

__all__ = ["check_atomic_save", "atomic_job", "saved_state"]


def saved_state(n):
    """The whole state a group of ``n`` ranks saves (what the check expects back)."""
    rows = sum(ROWS[n])
    return {"w": torch.arange(rows * WIDTH, dtype=torch.float32).view(rows, WIDTH),
            "bias": torch.arange(7, dtype=torch.float64) / 4, "step": 100, "losses": [2.5, 2.25]}


def _state(rank, n):
    whole, lo = saved_state(n), sum(ROWS[n][:rank])
    w = whole["w"]
    return {"w": ShardedTensor(w[lo:lo + ROWS[n][rank]].clone(), tuple(w.shape), (lo, 0)),
            "bias": whole["bias"], "step": whole["step"], "losses": whole["losses"]}


@contextmanager
def _slow_disk(first_s):
    """Every fsync FSYNC_S slower, the first one ``first_s`` more (this rank's data file)."""
    real, extra = os.fsync, [first_s]

    def fsync(fd):
        real(fd)
        time.sleep(FSYNC_S + extra.pop() if extra else FSYNC_S)

    os.fsync = fsync
    try:
        yield
    finally:
        os.fsync = real


def _files(path):
    stats = {p.name: p.stat() for p in Path(path).iterdir()} if Path(path).is_dir() else {}
    return {k: [s.st_size, s.st_ctime_ns, s.st_mtime_ns] for k, s in sorted(stats.items())}


def _index_ranks(path):
    try:
        index = json.loads((Path(path) / INDEX).read_text())
        return sorted({p["rank"] for t in index["tensors"].values() for p in t["pieces"]})
    except Exception:  # noqa: BLE001 - no index, or not one of course_lib's
        return None


def _attempt(fn, *args):
    try:
        return {"value": fn(*args)}
    except Exception as exc:  # noqa: BLE001 - reported, for the check to judge
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}


def _columns(path, rank, n):
    rows, c0 = sum(ROWS[n]), sum(COLUMNS[n][:rank])
    state = {"w": ShardedTensor(torch.zeros(rows, COLUMNS[n][rank]), (rows, WIDTH), (0, c0)),
             "bias": torch.zeros(7, dtype=torch.float64), "step": None, "losses": None}
    load(state, path)
    return {**state, "w": state["w"].local}


def atomic_job(sharded_save, pair):
    """On every rank: what it saw of the save, for the check (the group's rank 0 also
    reports the files, the index's ranks and the consolidated load)."""
    group = None
    if pair:  # every rank makes both groups; rank 0 is not in the one that saves
        alone, both = dist.new_group([0]), dist.new_group([1, 2])
        group = both if dist.get_rank() > 0 else alone
    member = not pair or dist.get_rank() > 0
    name = [tempfile.mkdtemp(prefix="lab08-atomic-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, group_src=0)
    path, out, ended = Path(name[0]) / "step_000100", {}, False
    try:
        if member:
            rank, n = dist.get_rank(group), dist.get_world_size(group)
            with _slow_disk(LATE_S * rank):
                sharded_save(_state(rank, n), path, group)
            out["committed_on_return"] = is_committed(path)
        dist.barrier()
        lead = member and rank == 0
        if member:
            out["columns"] = _attempt(_columns, path, rank, n)
        if lead:
            out.update(files=_files(path), ranks=_index_ranks(path),
                       whole=_attempt(consolidate, path))
        dist.barrier()
        if member:
            with _slow_disk(0.0):
                out["again"] = _attempt(sharded_save, _state(rank, n), path, group)
        dist.barrier()
        if lead:
            out["files_after"] = _files(path)
        ended = True
        return out
    finally:
        if ended:
            dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(name[0], ignore_errors=True)


@checks.check(EX_ATOMIC)
def check_atomic_save(sharded_save):
    for pair in (False, True):
        try:
            outs = yield on_ranks(atomic_job, sharded_save, pair, nproc=3, timeout=60)
        except checks.CheckFailed as exc:
            raise _in_group(exc, pair) from None
        _judge(outs[1:] if pair else outs, pair)
    return ("3 ranks and a group of 2 of 3, uneven rows, one slow rank: data, then the "
            "index, then the marker; the replicated tensor once; read back in columns; "
            "a committed directory refused")


def _in_group(exc, pair):
    """A failure of the student's code, saying which save it was and, for torch's
    "not part of group", what to pass instead."""
    where = ("\n(This was the save on ranks 1 and 2 of 3 as a group: group ranks 0 and 1.)"
             if pair else "")
    if "is not part of group" in str(exc):
        where += ("\nHint: dst / src of torch's object collectives are global ranks: give "
                  "group_dst=0 (the group's rank 0), or all-gather the descriptions.")
    failed = checks.CheckFailed(f"{exc}{where}", exercise=EX_ATOMIC)
    failed.stacks, failed.diagnosis = getattr(exc, "stacks", None), getattr(exc, "diagnosis", None)
    return failed


def _judge(outs, pair):
    n, lead, files = len(outs), outs[0], outs[0]["files"]
    on = "on ranks 1 and 2 of 3 as a group (its ranks 0 and 1)" if pair else f"on {n} ranks"
    data = sorted(name for name in files if DATA.fullmatch(name))

    def fail(what, hint):
        raise checks.CheckFailed(f"{EX_ATOMIC}: saved {on}, {what}.\nHint: {hint}")

    if COMMITTED not in files:
        if pair and data == ["rank00001.bin", "rank00002.bin"]:
            fail("the data files are rank00001.bin and rank00002.bin and nothing was "
                 "committed", "with a group, a rank is its rank in the group: "
                 "dist.get_rank(group) (0 and 1 here), not dist.get_rank(); the group's "
                 "rank 0 commits")
        fail(f"the directory holds {sorted(files)}: no {COMMITTED} marker once every rank "
             f"returned", "once it has every rank's descriptions, the group's rank 0 "
             "(dist.get_rank(group) == 0) writes the index and the marker: commit(path, "
             "everyone, values)")
    if INDEX not in files:
        fail(f"{COMMITTED} is there but not {INDEX}", "commit(path, everyone, values) "
             "writes the index, then the marker")
    appeared = {name: files[name][1] for name in files}
    before = [name for name in data if appeared[name] >= appeared[INDEX]]
    if before:
        fail(f"{INDEX} was written before the data file {before[-1]} was on disk (that rank's "
             f"disk is slow: its file landed {LATE_S * int(before[-1][4:9]):g} s after rank 0's)",
             "rank 0 committed without waiting for the other ranks. Gather every rank's "
             "descriptions to rank 0 first (dist.all_gather_object or dist.gather_object "
             "on the group): a rank joins the gather only once its data is written, so "
             "the gather is the wait; only then commit")
    if appeared[COMMITTED] <= appeared[INDEX]:
        fail(f"{COMMITTED} was written before {INDEX}", "the marker says the checkpoint is "
             "complete: a reader that sees it must find the index. Write the marker last: "
             "commit(path, everyone, values) writes the index, then the marker")
    early = [r for r, out in enumerate(outs) if not out["committed_on_return"]]
    if early:
        fail(f"sharded_save returned on rank(s) {early} before the checkpoint was committed",
             "end with a barrier on the group (dist.barrier(group=group)) after rank 0's "
             "commit, so that no rank goes on (to a load, to training, to the next save) "
             "before the checkpoint exists")
    if lead["ranks"] != list(range(n)):
        why = ("with a group, use the ranks in the group, dist.get_rank(group)"
               if pair and lead["ranks"] == [1, 2] else
               "did every rank write an index of its own pieces? Each one replaced the "
               "last, and the one left describes its writer's only. The group's rank 0 "
               "alone commits, with the list of every rank's descriptions (the gather)")
        fail(f"{INDEX} describes the pieces of rank(s) {lead['ranks']}, not of all the "
             f"ranks {list(range(n))}", why)
    _judge_values(outs, lead, n, fail)
    bias, got = saved_state(n)["bias"], sum(files[name][0] for name in data)
    want = sum(v.numel() * v.element_size() for v in saved_state(n).values() if torch.is_tensor(v))
    if got != want:
        copies = (got - want) / (bias.numel() * bias.element_size())
        fail(f"the data files hold {got} bytes where the state is {want} (its replicated "
             f"tensor 'bias' once)", (f"that is {copies:g} more copies of the replicated "
             f"tensor 'bias': a plain tensor is the same on every rank and only the "
             f"group's rank 0 writes it. " if copies == int(copies) and copies > 0 else "")
             + "Write exactly the tensors layout(state, path, rank) returns for this rank")
    raised = [r for r, out in enumerate(outs) if "error" in out["again"]]
    changed = sorted(k for k in set(files) | set(lead["files_after"])
                     if files.get(k) != lead["files_after"].get(k))
    if len(raised) < n or changed:
        did = (f"did not raise on rank(s) {[r for r in range(n) if r not in raised]}"
               if len(raised) < n else "raised")
        did += f" and changed {changed}" if changed else ""
        fail(f"a second sharded_save into the same, committed directory {did}",
             "a save never writes into a committed checkpoint: begin with "
             "refuse_committed(path), on every rank, before anything is written")


def _judge_values(outs, lead, n, fail):
    hint = ("each rank writes the tensors layout(state, path, rank) returns with "
            "write_data(path, rank, tensors); rank 0 commits the descriptions layout made")
    for where, got in [("consolidated", lead["whole"])] + [
            (f"in columns on rank {r}", out["columns"]) for r, out in enumerate(outs)]:
        if "error" in got:
            fail(f"course_lib's load could not read the checkpoint ({where}): {got['error']}",
                 hint)
    want, whole = saved_state(n), lead["whole"]["value"]
    columns = torch.cat([out["columns"]["value"]["w"] for out in outs], dim=1)
    for name, got, value in [(f"'{k}'", whole.get(k), v) for k, v in want.items()] + [
            ("'w' (loaded in columns)", columns, want["w"])]:
        if not (torch.is_tensor(got) and torch.equal(got, value) if torch.is_tensor(value)
                else got == value):
            fail(f"course_lib's load does not read back the {name} that was saved", hint)
