"""cluster/grade.sbatch run by bash on this machine, as two array tasks and the merge
step would run on nodes: a small class graded (sandboxes, the judge), slices merged."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course_lib.grading.labgen import make_lab

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "cluster" / "grade.sbatch"


def test_grade_template_is_valid_bash():
    subprocess.run(["bash", "-n", str(TEMPLATE)], check=True)


SOLVED = ("def shard_bounds(numel, rank, world):\n    ### BEGIN SOLUTION\n"
          "    padded = max(-(-numel // world) * world, world)\n    size = padded // world\n"
          "    return rank * size, (rank + 1) * size, padded\n    ### END SOLUTION")


def small_class(tmp_path):
    """A one-exercise lab (Lab 03's shard bounds, checked in the student's process) and
    four students, three of whom solved it."""
    setup = new_code_cell("from course_lib.grading import lab03")
    setup.metadata["tags"] = ["setup"]
    check = new_code_cell("lab03.check_shard_bounds(shard_bounds, trials=10)")
    check.metadata["tags"] = ["check"]
    nb = new_notebook(cells=[setup, new_markdown_cell("### Exercise 3.3: shard bounds"),
                             new_code_cell(SOLVED), check])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    (tmp_path / "solutions").mkdir()
    nbformat.write(nb, tmp_path / "solutions" / "03_small.ipynb")
    subs = tmp_path / "submissions"
    subs.mkdir()
    for name in ("ann", "ben", "cat"):
        nbformat.write(nb, subs / f"{name}.ipynb")
    nbformat.write(make_lab(nb), subs / "dan.ipynb")


def sbatch(tmp_path, **env):
    """Run the template as SLURM would run one of its tasks (the venv is this one)."""
    full = {**os.environ, "VENV": str(Path(sys.executable).parent.parent),
            "SUBMISSIONS": "submissions", "SOLUTIONS": "solutions", "OUT": "grades",
            "GRADE_TIMEOUT": "120", "JOBS": "1", "TMPDIR": str(tmp_path), **env}
    return subprocess.run(["bash", str(TEMPLATE)], cwd=tmp_path, env=full, capture_output=True,
                          text=True, timeout=300)


def read(path):
    return list(csv.DictReader(path.open()))


@pytest.mark.slow
@pytest.mark.notebook
def test_array_tasks_grade_their_slices_and_the_merge_makes_one_gradebook(tmp_path):
    small_class(tmp_path)
    for task in ("4", "5"):  # an array submitted as --array=4-5
        done = sbatch(tmp_path, SLURM_JOB_ID="77", SLURM_ARRAY_TASK_ID=task,
                      SLURM_ARRAY_TASK_MIN="4", SLURM_ARRAY_TASK_COUNT="2")
        assert done.returncode == 0, done.stderr[-2000:]
    parts = tmp_path / "grades" / "parts"
    assert [r["student"] for r in read(parts / "part-0.csv")] == ["ann", "cat"]
    assert [r["student"] for r in read(parts / "part-1.csv")] == ["ben", "dan"]
    done = sbatch(tmp_path, STEP="merge")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = read(tmp_path / "grades" / "gradebook.csv")
    assert [(r["student"], r["Exercise 3.3"], r["total"]) for r in rows] == [
        ("ann", "1", "1"), ("ben", "1", "1"), ("cat", "1", "1"), ("dan", "0", "0")]
    details = read(tmp_path / "grades" / "gradebook.details.csv")
    assert sorted(d["student"] for d in details) == ["ann", "ben", "cat", "dan"]
    assert sorted(p.name for p in (tmp_path / "grades" / "feedback").iterdir()) == [
        "ann.md", "ben.md", "cat.md", "dan.md"]


def test_grade_template_refuses_to_run_outside_an_array(tmp_path):
    done = sbatch(tmp_path)
    assert done.returncode != 0 and "run as an array job" in done.stderr
