"""Every lab's solution, handed in as a submission and graded as a class would be (checks
only, two at a time): full marks from the judge, as in the kernel's check cells (nbval
runs those). (The untouched labs score nothing: test_gradebook.py.)"""
import csv
import shutil
import time
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import gradebook as grade
from course_lib.grading.labgen import exercises_in

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.notebook]


def test_every_solution_scores_every_exercise(tmp_path):
    subs = tmp_path / "submissions"
    subs.mkdir()
    names = sorted(p.name for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
    for name in names:
        shutil.copy(ROOT / "solutions" / name, subs / f"student_{name[:2]}.ipynb")
    out = tmp_path / "grades" / "gradebook.csv"
    started = time.monotonic()
    assert grade.main([str(subs), "--solutions", str(ROOT / "solutions"), "--out", str(out),
                       "--jobs", "2"]) == 0
    seconds = time.monotonic() - started
    print(f"{len(names)} solutions graded in {seconds:.0f} s with --jobs 2: "
          f"{seconds / len(names):.1f} s per notebook")
    rows = {r["student"]: r for r in csv.DictReader(out.open())}
    for name in names:
        exercises = [ex for ex, _ in exercises_in(nbformat.read(ROOT / "solutions" / name, 4))]
        row = rows[f"student_{name[:2]}"]
        assert row["status"] == "ok" and row["flags"] == "", (name, row)
        assert int(row["total"]) == len(exercises), (name, row)
    details = list(csv.DictReader(out.with_name("gradebook.details.csv").open()))
    assert all(d["status"] == "pass" for d in details), [d for d in details
                                                          if d["status"] != "pass"]
