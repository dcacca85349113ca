"""The gradebook: run a folder of submitted notebooks, one row per student.

    python -m course_lib.grading.gradebook submissions/ --out gradebook.csv

``submissions/<student>/NN_name.ipynb`` (or ``submissions/<student>.ipynb``).
Before running, every cell tagged ``check`` is restored from the generated lab
(matched by cell id), so an edited check cannot pass itself. A column
``Exercise N.M`` scores 1 when that exercise's own (restored) check cell
printed the whole line ``✓ Exercise N.M passed`` and raised nothing, else 0.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

import nbformat

from course_lib.grading.checks import PASS_MARK
from course_lib.grading.labgen import EXERCISE_HEADING, exercises_in, make_lab

# A pass is this whole line, printed to stdout by the check cell of that exercise.
PASS_LINE = re.compile("^" + re.escape(PASS_MARK) + r" (Exercise \d+\.\d+) passed( \(.*\))?$")


def restore_checks(submission, lab):
    """Replace the submission's check cells by the lab's (same cell id)."""
    originals = {c.get("id"): c for c in lab.cells if "check" in c.metadata.get("tags", [])}
    for i, cell in enumerate(submission.cells):
        if cell.get("id") in originals:
            original = originals[cell.get("id")]
            submission.cells[i] = nbformat.from_dict({**original, "outputs": [],
                                                      "execution_count": None})
    return submission, set(originals)


def passed_exercises(nb, check_ids):
    """The exercises whose own check cell printed their pass line, as a whole
    line on stdout, and raised nothing. A check cell belongs to the exercise of
    the nearest ``Exercise N.M`` heading above it; a pass line printed anywhere
    else (a student's cell, another exercise's check, the middle of a line)
    counts for nothing."""
    found, exercise = set(), None
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            headings = EXERCISE_HEADING.findall(cell.source)
            if headings:
                exercise = headings[-1][0]
            continue
        if cell.cell_type != "code" or cell.get("id") not in check_ids or exercise is None:
            continue
        if any(o.get("output_type") == "error" for o in cell.outputs):
            continue
        text = "".join(o.get("text", "") for o in cell.outputs
                       if o.get("output_type") == "stream" and o.get("name") == "stdout")
        if any(m and m.group(1) == exercise for m in map(PASS_LINE.match, text.splitlines())):
            found.add(exercise)
    return found


def execute_submission(path, lab, timeout=900):
    """Run a submission (check cells restored) to the end, errors and all.
    Returns the executed notebook and the ids of its check cells."""
    from nbclient import NotebookClient

    nb, check_ids = restore_checks(nbformat.read(path, as_version=4), lab)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(Path(path).parent)}})
    client.execute()
    return nb, check_ids


def grade_notebook(path, lab, timeout=900):
    return passed_exercises(*execute_submission(path, lab, timeout))


def _submissions(folder):
    folder = Path(folder)
    for entry in sorted(folder.iterdir()):
        if entry.is_dir():
            yield entry.name, sorted(entry.glob("[0-9][0-9]_*.ipynb"))
        elif entry.suffix == ".ipynb":
            yield entry.stem, [entry]


def gradebook(folder, solutions="solutions", timeout=900):
    """[{student, Exercise N.M: 0/1 ..., total}] for every submission."""
    solution_nbs = {p.name[:2]: p for p in sorted(Path(solutions).glob("[0-9][0-9]_*.ipynb"))}
    labs = {k: make_lab(nbformat.read(p, as_version=4), p.name) for k, p in solution_nbs.items()}
    columns = [ex for k in sorted(labs) for ex, _ in exercises_in(labs[k])]
    rows = []
    for student, notebooks in _submissions(folder):
        passed = set()
        for nb_path in notebooks:
            lab = labs.get(nb_path.name[:2])
            if lab is None:
                print(f"{student}: {nb_path.name} matches no solution notebook, skipped")
                continue
            print(f"grading {student}/{nb_path.name} ...", flush=True)
            passed |= grade_notebook(nb_path, lab, timeout)
        row = {"student": student, **{ex: int(ex in passed) for ex in columns}}
        row["total"] = sum(row[ex] for ex in columns)
        rows.append(row)
    return columns, rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m course_lib.grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submissions")
    parser.add_argument("--out", default="gradebook.csv")
    parser.add_argument("--solutions", default="solutions")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per cell")
    ns = parser.parse_args(argv)
    if not Path(ns.submissions).is_dir():
        print(f"error: no submissions folder {ns.submissions!r}", file=sys.stderr)
        return 2
    columns, rows = gradebook(ns.submissions, ns.solutions, ns.timeout)
    with open(ns.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["student", *columns, "total"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {ns.out}: {len(rows)} student(s), {len(columns)} exercise(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
