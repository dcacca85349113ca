"""Generate student labs from solution notebooks (nbgrader's markers).

In ``solutions/NN_name.ipynb`` every region between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` becomes, in ``labs/NN_name.ipynb``, a stub at the
marker's indentation::

    raise NotImplementedError("Exercise 0.2: token ring")

The exercise id and title come from the nearest markdown heading above that
reads ``Exercise N.M: title``. ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN
TESTS`` regions are dropped (the grader puts them back: ``keep_hidden``).
Outputs, execution counts and nbgrader's cell metadata are cleared. A marker
left open, nested, closed without opening, or a solution with no exercise
heading above it is an error naming the notebook, cell and line.

The solutions also carry nbgrader's cell metadata, so that a course on nbgrader
can take them as its source notebooks: a cell with a solution region is a
solution cell, a check cell is a locked grade cell worth one point, and each
``grade_id`` is the exercise id (``exercise_0_1``, ``exercise_0_1_solution``).
``--nbgrader`` (re)writes that metadata, and nothing else, into the solutions.

    python -m course_lib.grading.labgen solutions labs            # write labs/
    python -m course_lib.grading.labgen solutions labs --check    # exit 1 if labs/ is stale
    python -m course_lib.grading.labgen --nbgrader solutions [--check]   # nbgrader metadata
    python -m course_lib.grading.labgen --record solutions/00_launch.ipynb   # nbval's outputs
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import nbformat

from course_lib.grading import ids

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
EXERCISE_HEADING = ids.HEADING  # "Exercise N.M: title" or "Prediction N.M: title"
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
MARKDOWN_STUB = "_Your answer here._"


class LabGenError(ValueError):
    pass


def exercises_in(nb):
    """[(id, title)] of the exercise headings of a notebook, in order."""
    found = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            found += [(ids.normalize(m.group(1)), m.group(3).strip())
                      for m in EXERCISE_HEADING.finditer(cell.source)]
    return found


def strip_source(source, exercise, where, markdown=False, keep_hidden=False):
    """Replace solution regions in one cell's source; drop hidden-test regions (with
    ``keep_hidden``, only their marker lines)."""
    out, region, indent, start = [], None, "", 0
    for lineno, line in enumerate(source.splitlines(), 1):
        marker = line.strip()
        if marker in (BEGIN, BEGIN_HIDDEN):
            if region is not None:
                raise LabGenError(f"{where}, line {lineno}: {marker!r} inside an open {region!r} "
                                  f"(opened on line {start}); markers cannot nest")
            if marker == BEGIN and exercise is None:
                raise LabGenError(f"{where}, line {lineno}: a solution region with no "
                                  f"'Exercise N.M: title' heading above it")
            region, indent, start = marker, line[: len(line) - len(line.lstrip())], lineno
            if marker == BEGIN:
                ex_id, title = exercise
                label = f"{ex_id}: {title}" if title else ex_id
                out.append(MARKDOWN_STUB if markdown else
                           f"{indent}raise NotImplementedError({label!r})")
        elif marker in (END, END_HIDDEN):
            expected = BEGIN if marker == END else BEGIN_HIDDEN
            if region != expected:
                raise LabGenError(f"{where}, line {lineno}: {marker!r} without a matching "
                                  f"{expected!r}")
            region = None
        elif region is None or (region == BEGIN_HIDDEN and keep_hidden):
            out.append(line)
    if region is not None:
        raise LabGenError(f"{where}, line {start}: {region!r} is never closed")
    return "\n".join(out)


def make_lab(nb, name="notebook", keep_hidden=False):
    """A new notebook: ``nb`` with solutions stubbed and outputs cleared (and, unless
    ``keep_hidden``, hidden tests removed: what the grader runs keeps them)."""
    lab = nbformat.reads(nbformat.writes(nb), as_version=4)
    exercise = None
    for index, cell in enumerate(lab.cells):
        where = f"{name}, cell {index}"
        if cell.cell_type == "markdown":
            source = cell.source
            headings = list(EXERCISE_HEADING.finditer(source))
            cell.source = strip_source(source, exercise, where, markdown=True,
                                       keep_hidden=keep_hidden)
            if headings:
                exercise = (ids.normalize(headings[-1].group(1)), headings[-1].group(3).strip())
        elif cell.cell_type == "code":
            cell.source = strip_source(cell.source, exercise, where, keep_hidden=keep_hidden)
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("nbgrader", None)  # the students' copy is not an nbgrader release
    lab.metadata = {"kernelspec": dict(KERNELSPEC),
                    "language_info": {"name": "python"}}
    return lab


def render(nb):
    return nbformat.writes(nb) + "\n"


def generate(solutions_dir, labs_dir, check=False):
    """Write (or, with ``check``, compare) every lab. Returns the stale lab paths."""
    solutions_dir, labs_dir = Path(solutions_dir), Path(labs_dir)
    stale = []
    sources = sorted(solutions_dir.glob("[0-9][0-9]_*.ipynb"))
    if not sources:
        raise LabGenError(f"no solution notebooks (NN_name.ipynb) in {solutions_dir}")
    for src in sources:
        text = render(make_lab(nbformat.read(src, as_version=4), src.name))
        dst = labs_dir / src.name
        if not dst.exists() or dst.read_text() != text:
            stale.append(dst)
            if not check:
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_text(text)
    expected = {s.name for s in sources}
    orphans = [p for p in sorted(labs_dir.glob("*.ipynb")) if p.name not in expected]
    if not check:
        for path in orphans:  # labs/ is generated: a lab without a solution goes
            path.unlink()
    return stale + orphans


# ---- nbgrader's cell metadata on the solutions ------------------------------------------------
NBGRADER_SCHEMA = 3


def grade_id(exercise, suffix=""):
    """nbgrader's id for ``exercise`` ("Exercise 0.1" -> "exercise_0_1"): its ids allow
    only letters, digits, ``_`` and ``-``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", exercise).strip("_").lower() + suffix


def nbgrader_cells(nb, name="notebook"):
    """[nbgrader metadata or None] for each cell of a solution notebook: solution cells
    (a solution region), grade cells (tag ``check``: locked, one point), nothing else."""
    found, exercise, solutions, checked = [], None, {}, set()
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            headings = EXERCISE_HEADING.findall(cell.source)
        has_solution = any(line.strip() == BEGIN for line in cell.source.splitlines())
        meta = None
        if "check" in cell.metadata.get("tags", []):
            if exercise is None:
                raise LabGenError(f"{name}, cell {index}: a check cell with no 'Exercise N.M' "
                                  f"heading above it")
            meta = {"grade": True, "solution": False, "locked": True, "points": 1,
                    "grade_id": grade_id(exercise)}
            checked.add(exercise)
        elif has_solution and exercise is not None:
            count = solutions[exercise] = solutions.get(exercise, 0) + 1
            meta = {"grade": cell.cell_type == "markdown", "solution": True, "locked": False,
                    "grade_id": grade_id(exercise, "_solution" + (f"_{count}" if count > 1 else ""))}
            if cell.cell_type == "markdown":  # nbgrader grades a written answer by hand
                meta["points"] = 0
        if meta is not None:
            meta["schema_version"] = NBGRADER_SCHEMA
        found.append(meta)
        if cell.cell_type == "markdown" and headings:
            exercise = headings[-1][0]
    # a code solution without a check cell is an item no gradebook would ever grade
    unchecked = [ex for ex in solutions if ex not in checked and any(
        m and m["grade_id"].startswith(grade_id(ex, "_solution")) and not m["grade"]
        for m in found)]
    if unchecked:
        raise LabGenError(f"{name}: {', '.join(unchecked)} has a solution cell but no cell "
                          f"tagged 'check' (the cell that calls its check needs the tag)")
    return found


def _notebook_json(data):
    """The text nbformat writes for ``data`` (sorted keys, one-space indent)."""
    return json.dumps(data, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def stamp_nbgrader(path, check=False):
    """Write nbgrader's metadata into a solution notebook, touching nothing but the
    ``nbgrader`` key of cell metadata. Returns True when it was (or, with ``check``,
    would be) changed. Refuses a file nbformat did not write as is, rather than
    reformat someone's notebook."""
    path = Path(path)
    text = path.read_text()
    data = json.loads(text)
    if _notebook_json(data) not in (text, text + "\n"):
        raise LabGenError(f"{path}: not in nbformat's own layout; open and save it with "
                          f"nbformat (make labs) first")
    wanted = nbgrader_cells(nbformat.reads(text, as_version=4), path.name)
    for cell, meta in zip(data["cells"], wanted):
        if meta is None:
            cell.get("metadata", {}).pop("nbgrader", None)
        else:
            cell.setdefault("metadata", {})["nbgrader"] = meta
    new = _notebook_json(data)
    if new == text:
        return False
    if not check:
        path.write_text(new)
    return True


def record_checked_outputs(path, timeout=900):
    """Execute a solution notebook and store outputs only in the cells nbval
    compares (``# NBVAL_CHECK_OUTPUT``); every other cell is left without output."""
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    executed = nbformat.reads(nbformat.writes(nb), as_version=4)
    NotebookClient(executed, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    for cell, done in zip(nb.cells, executed.cells):
        if cell.cell_type != "code":
            continue
        checked = "NBVAL_CHECK_OUTPUT" in cell.source
        cell.outputs = done.outputs if checked else []
        cell.execution_count = done.execution_count if checked else None
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.labgen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("solutions", nargs="?", default="solutions")
    parser.add_argument("labs", nargs="?", default="labs")
    parser.add_argument("--check", action="store_true", help="only report stale labs")
    parser.add_argument("--nbgrader", action="store_true",
                        help="(re)write nbgrader's cell metadata into the solution notebooks")
    parser.add_argument("--record", metavar="NOTEBOOK", nargs="+",
                        help="execute these solution notebooks and store the outputs of "
                             "their NBVAL_CHECK_OUTPUT cells (authors only)")
    ns = parser.parse_args(argv)
    if ns.record:
        for path in ns.record:
            record_checked_outputs(path)
            print(f"recorded checked outputs of {path}")
    if ns.nbgrader:
        try:
            changed = [p for p in sorted(Path(ns.solutions).glob("[0-9][0-9]_*.ipynb"))
                       if stamp_nbgrader(p, check=ns.check)]
        except LabGenError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for path in changed:
            print(("stale nbgrader metadata: " if ns.check else "wrote: ") + str(path))
        return 1 if ns.check and changed else 0
    try:
        stale = generate(ns.solutions, ns.labs, check=ns.check)
    except LabGenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in stale:
        print(("stale: " if ns.check else "wrote: ") + str(path))
    if ns.check and stale:
        print("labs/ is out of date: run `make labs`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
