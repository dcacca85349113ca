"""Lab 02 through the gradebook, with the library's answers its other items are built on
reached by a dotted string: Exercise 2.4 and 2.5's checks run on the library's DDP (2.3's
answer), which buckets with assign_buckets (2.2's), and 2.3's frame is handed Bucket
(2.6's). Before grading/shipping.py those pieces stayed in the sandbox and these two
tamperings were credited (with a flag only); now the sandbox holds stand-ins, the
checks built on them run the judge's copy, sent by value, and 2.3 gets Bucket back on
its ranks. A piece sent that way is within the student's reach on the ranks (2.4's
train_step is handed the library's DDP, an answer to 2.6); the ranks end before 2.6
is decided (grading/apart.py), so a stash left there in 2.4 is gone by then."""
import csv
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import gradebook as grade
from course_lib.grading.sandbox import bwrap_works

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.notebook,
              pytest.mark.skipif(not bwrap_works(), reason="needs bwrap (Debian's bubblewrap)")]

# Exercise 2.2: the library's bucket plan, by a name no reader follows
PLANS_BY_STRING = '''import importlib


def assign_buckets(sizes_bytes, cap_bytes):
    return importlib.import_module("course_lib.ddp.buckets").assign_buckets(sizes_bytes,
                                                                            cap_bytes)
'''
# Exercise 2.6: "from a blank page", the library's DDP itself
RETURNS_THE_LIBRARYS_DDP = '''import importlib


class MyDDP(nn.Module):
    def __new__(cls, module, bucket_cap_mb=25.0, process_group=None):
        impl = importlib.import_module("course_lib.ddp.bucketed").DDP
        return impl(module, bucket_cap_mb=bucket_cap_mb, process_group=process_group)
'''
# Exercise 2.4 keeps the library's DDP it was handed on the (warm) rank, where
# Exercise 2.6's "blank page" then finds it
STASHES_WHAT_IT_WAS_HANDED = '''def train_step(model, opt, x, y, micro_batches):
    import collections
    collections.stashed_ddp = type(model)
'''
USES_THE_STASH = '''class MyDDP(nn.Module):
    def __new__(cls, module, bucket_cap_mb=25.0, process_group=None):
        import collections
        return collections.stashed_ddp(module, bucket_cap_mb=bucket_cap_mb,
                                       process_group=process_group)
'''


def _replaced(nb, defines, source):
    cell = next(c for c in nb.cells if c.cell_type == "code" and defines in c.source)
    cell.source = source


def test_answers_other_items_are_built_on_are_out_of_reach_and_those_items_still_pass(tmp_path):
    nb = nbformat.read(ROOT / "solutions" / "02_ddp.ipynb", 4)
    _replaced(nb, "def assign_buckets", PLANS_BY_STRING)
    _replaced(nb, "class MyDDP", RETURNS_THE_LIBRARYS_DDP)
    subs = tmp_path / "submissions"
    subs.mkdir()
    nbformat.write(nb, subs / "borrower.ipynb")
    nb = nbformat.read(ROOT / "solutions" / "02_ddp.ipynb", 4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "def train_step" in c.source)
    cell.source = cell.source.replace("def train_step(model, opt, x, y, micro_batches):\n",
                                      STASHES_WHAT_IT_WAS_HANDED)
    _replaced(nb, "class MyDDP", USES_THE_STASH)
    nbformat.write(nb, subs / "stasher.ipynb")
    out = tmp_path / "grades" / "gradebook.csv"
    assert grade.main([str(subs), "--solutions", str(ROOT / "solutions"), "--out", str(out),
                       "--jobs", "2"]) == 0
    details = {(d["student"], d["exercise"]): d
               for d in csv.DictReader(out.with_name("gradebook.details.csv").open())}
    rows = {r["student"]: r for r in csv.DictReader(out.open())}
    for exercise in ("Exercise 2.2", "Exercise 2.6"):
        got = details[("borrower", exercise)]
        assert got["status"] == "fail", got
        assert "is the library's answer to" in got["message"], got
    # the frame of 2.3 buckets with the student's own assign_buckets: it goes down with 2.2
    assert "answer to Exercise 2.2" in details[("borrower", "Exercise 2.3")]["message"]
    # built on the hidden pieces: the library's DDP and its buckets (2.4, 2.5)
    for exercise in ("Exercise 2.4", "Exercise 2.5"):
        assert details[("borrower", exercise)]["status"] == "pass", details[("borrower", exercise)]
    assert "importlib.import_module" in rows["borrower"]["flags"], rows["borrower"]
    # the stash is on ranks ended before 2.6 is decided; 2.4 itself was honest work
    assert details[("stasher", "Exercise 2.4")]["status"] == "pass"
    assert details[("stasher", "Exercise 2.6")]["status"] == "fail", \
        details[("stasher", "Exercise 2.6")]
    assert "stashed_ddp" in details[("stasher", "Exercise 2.6")]["message"]
    # (an honest Lab 02, its 2.3 handed Bucket on its own ranks, scores 8 of 8 unflagged:
    # test_solutions_judged.py grades it with every other solution)
