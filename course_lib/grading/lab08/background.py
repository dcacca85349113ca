"""Exercise 8.6, an asynchronous save: the student's ``AsyncSaver`` (``save(state, path,
group=None)`` returns once the loop may change ``state``; ``wait()`` returns once the save
in flight is on disk, committed on rank 0, and raises what went wrong in it).

One job on 3 ranks. Every file course_lib writes goes through
``course_lib.checkpoint.save.write_atomically``, which the job holds shut for any thread
but the main one until it opens a gate: what a background thread writes waits there,
before a byte of it is read from the tensors. Group rank r's first background write then
lands 0.3 r s late (an uneven disk). The saver is made with ``timeout=5``. The job, in
order:

1. saves a known state into ``a`` (the gate shut), notes whether this rank's data file
   was already there when ``save`` returned, then changes the state in place, as the
   next training step would;
2. saves another into ``b`` at once, the gate opening 1.5 s later from a timer: a ``save``
   that waits for the one in flight returns after it, with ``a`` written (committed on
   rank 0); one that does not returns before;
3. ``wait()``, then reads ``a`` and ``b`` back with course_lib's load, and lists their
   files (when each appeared under its name);
4. a save into ``c`` whose rank 1 cannot write (a full disk): its ``wait()`` must raise
   that, and rank 0's, after the timeout, that rank 1's data never came (a ``wait()``
   still waiting 15 s later is reported as hung);
5. a save into ``b`` again: refused, nothing changed (and not the third save's error
   raised again);
6. a save into ``c``, where the failed save left rank 0's and rank 2's data files,
   rank 2's disk 0.6 s late: rank 0 must commit on this save's files, not the old ones.

Meanwhile it notes every ``torch.distributed`` call made off the main thread. The job is
:mod:`course_lib.grading.lab08.background_job`; the verdict is all here.
"""
from __future__ import annotations

import torch

from course_lib.checkpoint.files import COMMITTED, INDEX
from course_lib.grading import checks
from course_lib.grading.lab08.atomic import saved_state
from course_lib.grading.lab08.background_job import (EX_ASYNC, FULL, HANG_S, LATE_S, N,
                                                     TIMEOUT_S, async_job)
from course_lib.grading.requests import on_ranks

__all__ = ["check_async_save"]


@checks.check(EX_ASYNC)
def check_async_save(AsyncSaver):
    outs = yield on_ranks(async_job, AsyncSaver, nproc=N, timeout=90)
    _judge(outs)
    return ("3 ranks, a slow uneven disk: save() returns before the disk, the state changed "
            "after it is not what was saved, collectives on the loop's thread, one save in "
            "flight, rank 0 commits after every data file, a failed write raised by wait(), "
            "a rank that never writes timed out by name, a committed directory refused")


def _fail(what, hint):
    raise checks.CheckFailed(f"{EX_ASYNC}: {what}.\nHint: {hint}")


def _judge(outs):
    ranks = range(len(outs))
    for r in ranks:
        if "error" in outs[r]["wait"]:
            _fail(f"wait() raised on rank {r} after two good saves: {outs[r]['wait']['error']}",
                  "a save that went well leaves nothing for wait() to raise")
    early = [r for r in ranks if outs[r]["data_on_return"]]
    if early:
        _fail(f"save() returned on rank(s) {early} with the data file already written: the "
              f"training loop waited for the disk", "copy the state and agree on the index "
              "in save(), then hand the writing (write_data, and rank 0's commit) to a "
              "background thread (threading.Thread(target=..., daemon=True).start()) and "
              "return")
    off = sorted({name for r in ranks for name in outs[r]["off_main"]})
    if off:
        _fail(f"torch.distributed's {', '.join(off)} ran on the background thread", "every "
              "collective stays on the training loop's thread: two threads issuing "
              "collectives on one communicator can deadlock on NCCL. Gather every rank's "
              "descriptions in save(), before starting the thread; rank 0's thread then "
              "waits for the other ranks' data files on the disk instead of a collective")
    if not all(outs[r]["first_written"] for r in ranks) or not outs[0]["first_committed"]:
        _fail("the second save() returned while the first was still writing (its data "
              "file, or rank 0's commit, was not there yet)", "begin save() with wait(): "
              "one save in flight at a time, so one copy of the state in host memory, and "
              "saves that commit in order")
    want = sum(v.numel() * v.element_size() for v in saved_state(N).values()
               if torch.is_tensor(v))
    returned = [outs[r]["returned"] for r in ranks]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in returned) \
            or sum(returned) != want:
        _fail(f"save() returned {returned} on ranks 0..{N - 1}: the bytes each rank's data "
              f"file will hold, which add up to the state's {want}", "return the sizes of "
              "the tensors layout(...) gives this rank, summed (numel() * element_size()), "
              "as course_lib's save returns what it wrote")
    not_yet = [r for r in ranks if not outs[r]["committed_after_wait"]]
    if 0 in not_yet:
        _fail("wait() returned on rank 0 before the checkpoint was committed", "wait() "
              "joins the thread (thread.join()); on rank 0 the thread ends after commit")
    _judge_files(outs[0]["a"], "the first save")
    _judge_files(outs[0]["b"], "the second save")
    _judge_values(outs[0])
    dead, lead = outs[1]["full_wait"], outs[0]["full_wait"]
    if "error" not in dead and "error" not in outs[1]["full"]:
        _fail(f"a save whose writes failed on rank 1 ({FULL}) raised nothing there, in "
              f"save() or in wait()", "an exception in a thread ends the thread, and "
              "nobody sees it: catch it in the thread (try/except BaseException), keep it, "
              "and raise it from wait(), once (then forget it)")
    if lead.get("hung") or "error" not in lead:
        said = (f"was still waiting {HANG_S:g} s later" if lead.get("hung") else
                "returned as if all was well")
        _fail(f"rank 1 never wrote its data file for the third save, and rank 0's wait() "
              f"{said} (the saver was made with timeout={TIMEOUT_S:g})", "rank 0's thread "
              "waits for the files with a deadline, time.monotonic() + timeout; past it, it "
              "gives up without committing and keeps an error for wait() to raise")
    if "rank00001.bin" not in lead["error"]:
        _fail(f"rank 0's wait() raised {lead['error']!r} when rank 1's data never came",
              "say what is missing: the names of the data files that never appeared "
              "(data_file(r)), so that whoever reads the log knows which rank to look at")
    again = [outs[r]["again"].get("error", "") for r in ranks]
    if any(FULL in e or "rank00001.bin" in e for e in again):
        _fail("a save after the failed one raised the failed save's error again",
              "wait() raises a kept error once, then forgets it (sets it back to None): the "
              "next save is a new one")
    raised = [r for r in ranks if "error" in outs[r]["again"]]
    if len(raised) < len(outs) or outs[0]["b_after"] != outs[0]["b"]["files"]:
        _fail("a save into the committed directory of the second one was not refused on "
              "every rank, or changed its files", "begin with refuse_committed(path), in "
              "save(), on every rank, before anything is written")
    if "c" in outs[0]:
        _judge_resave(outs)


def _judge_resave(outs):
    """Step 6: a save into the directory the failed save left behind."""
    bad = [(r, outs[r]["resave"].get("error") or outs[r]["resave_wait"].get("error")
            or "still waiting") for r in range(len(outs))
           if "error" in outs[r]["resave"] or "error" in outs[r]["resave_wait"]
           or outs[r]["resave_wait"].get("hung")]
    if bad:
        _fail(f"a save into the directory the failed save left (never committed) failed on "
              f"rank {bad[0][0]}: {bad[0][1]}", "a directory without the marker holds no "
              "checkpoint: a new save may write there (refuse_committed lets it)")
    files = outs[0]["c"]["files"]
    late = files.get("rank00002.bin", [0, 0])[1]
    if INDEX in files and COMMITTED in files and late >= files[INDEX][1]:
        _fail("rank 0 committed the save into the failed save's directory before rank 2's "
              "new data file was on disk: it found the file rank 2 wrote in the failed save",
              "a save that died leaves its files behind: each rank removes its own data "
              "file, path / data_file(rank), in save() before the gather, so that every "
              "data file rank 0 finds after the gather is this save's")
    _judge_files(outs[0]["c"], "the save into the failed save's directory")


def _judge_files(seen, which):
    files = seen["files"]
    if COMMITTED not in files or INDEX not in files:
        _fail(f"after wait(), {which}'s directory holds {sorted(files)}: not committed",
              "rank 0's thread writes the index and the marker, commit(path, everyone, "
              "values), once every rank's data file is on disk")
    data = sorted(name for name in files if name.startswith("rank") and name.endswith(".bin"))
    late = [name for name in data if files[name][1] >= files[INDEX][1]]
    if late or len(data) < N:
        _fail(f"rank 0 wrote {which}'s index before the data file "
              f"{(late or ['of every rank'])[-1]} was on disk (rank 2's disk is "
              f"{2 * LATE_S:g} s slower than rank 0's)", "with no collective on the thread, "
              "rank 0's thread waits until every rank's data file exists (path / "
              "data_file(r) for each group rank r: write_data renames a file into place "
              "only once it is whole), then commits")


def _judge_values(lead):
    want = saved_state(N)
    for which in ("a", "b"):
        got = lead[which]["whole"]
        if "error" in got:
            _fail(f"course_lib's load could not read the {which == 'a' and 'first' or 'second'}"
                  f" checkpoint: {got['error']}", "each rank writes the tensors layout(...) "
                  "returns; rank 0 commits every rank's descriptions")
        got = got["value"]
        for key, value in want.items():
            same = (torch.is_tensor(got.get(key)) and torch.equal(got[key], value)
                    if torch.is_tensor(value) else got.get(key) == value)
            if not same:
                changed = (which == "a" and torch.is_tensor(value)
                           and torch.is_tensor(got.get(key))
                           and torch.equal(got[key], value + 1000))
                changed = changed or (which == "a" and key == "losses"
                                      and got.get(key) == value + [0.0])
                if changed:
                    _fail(f"the first checkpoint holds '{key}' as the training loop left it "
                          f"after save() returned, not as it was handed to save()",
                          "the loop goes on changing the state while the thread writes: "
                          "copy every tensor (and the plain values) in save(), before "
                          "returning, and write the copies (map_state(state, copy_tensor, "
                          "copy.deepcopy) copies a state's tensors and values)")
                _fail(f"course_lib's load does not read back the '{key}' that was saved "
                      f"({which == 'a' and 'first' or 'second'} checkpoint)", "write exactly "
                      "the tensors layout(state, path, rank) returns for this rank")
