"""Finding submissions, recognising their lab, and preparing them to be graded.

A submissions folder holds ``<student>/<any name>.ipynb`` (one or more labs per
student) or ``<student>.ipynb`` (one notebook per student), or both. Which lab a
notebook is comes from its content: the exercise ids of its headings and the ids
of its check cells, never its file name.

Preparing a notebook for the grader (:func:`prepare`):

- every check cell of the lab is put back as the solution has it, hidden tests
  included: found by cell id, else as the cell tagged ``check`` under the same
  exercise heading, else inserted at the end of that exercise's section; an
  edited, moved or missing check cell is flagged;
- a cell tagged ``injected-parameters`` goes after the ``parameters`` cell (as
  papermill does), so that what the notebook writes lands outside the
  submissions folder.
"""
from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell

from course_lib.grading.labgen import (BEGIN, EXERCISE_HEADING, LabGenError, exercises_in,
                                      make_lab, strip_source)


@dataclass
class CheckCell:
    id: str
    exercise: str
    source: str  # as the grader runs it: hidden tests kept
    lab_source: str  # as the students' lab shows it


@dataclass
class Lab:
    key: str  # the solution's file name without .ipynb, e.g. "00_launch"
    solution: Path
    lab: nbformat.NotebookNode  # the students' version
    exercises: list  # [(id, title)]
    checks: list  # [CheckCell], in notebook order
    # names the lab binds to check modules: {name: "module"} or {name: "module:attribute"}
    check_names: dict = field(default_factory=dict)
    setup_ids: set = field(default_factory=set)  # cells tagged "setup": what exercises need
    solution_ids: set = field(default_factory=set)  # cells holding a solution region
    cell_ids: set = field(default_factory=set)  # every cell of the lab

    @property
    def exercise_ids(self):
        return [ex for ex, _ in self.exercises]

    @property
    def check_modules(self):
        return sorted({target.split(":")[0] for target in self.check_names.values()})

    @property
    def code_sources(self):
        return [c.source for c in self.lab.cells if c.cell_type == "code"]


def lab_checks(grading, shown=None):
    """[CheckCell] of a lab notebook (``shown``: the students' version, if ``grading``
    keeps hidden tests)."""
    checks, exercise = [], None
    for cell, seen in zip(grading.cells, (shown or grading).cells):
        if cell.cell_type == "markdown":
            headings = EXERCISE_HEADING.findall(cell.source)
            exercise = headings[-1][0] if headings else exercise
        elif "check" in cell.metadata.get("tags", []) and exercise is not None:
            checks.append(CheckCell(cell.get("id"), exercise, cell.source, seen.source))
    return checks


def load_lab(path):
    path = Path(path)
    solution = nbformat.read(path, as_version=4)
    lab = make_lab(solution, path.name)
    grading = make_lab(solution, path.name, keep_hidden=True)
    return Lab(path.stem, path, lab, exercises_in(lab), lab_checks(grading, lab),
               _check_names(lab),
               setup_ids={c.get("id") for c in solution.cells
                          if "setup" in c.metadata.get("tags", [])},
               solution_ids={c.get("id") for c in solution.cells
                             if c.cell_type == "code" and BEGIN in c.source},
               cell_ids={c.get("id") for c in lab.cells})


def _check_names(lab):
    """Names the lab's imports bind to course_lib.grading modules (or their attributes)."""
    names = {}
    for cell in lab.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse("\n".join(line for line in cell.source.splitlines()
                                       if not line.lstrip().startswith(("%", "!"))))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib.grading"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    names[alias.asname or alias.name] = target if _is_module(target) else \
                        f"{node.module}:{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name.startswith("course_lib.grading."):
                        names[alias.asname] = alias.name
    return names


def _is_module(name):
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def load_labs(solutions):
    paths = sorted(Path(solutions).glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no solution notebooks (NN_name.ipynb) in {solutions}")
    return {p.stem: load_lab(p) for p in paths}


# ---- finding submissions ----------------------------------------------------------------------
@dataclass
class Submission:
    student: str
    notebooks: list  # [Path]


def find_submissions(folder):
    """[Submission] of a folder, by student name (both layouts, mixed if need be)."""
    found = {}
    for entry in sorted(Path(folder).iterdir()):
        if entry.name.startswith((".", "_")):
            continue
        if entry.is_dir():
            notebooks = sorted(p for p in entry.rglob("*.ipynb") if not any(
                part.startswith((".", "_")) for part in p.relative_to(entry).parts))
            found.setdefault(entry.name, []).extend(notebooks)
        elif entry.suffix == ".ipynb":
            found.setdefault(entry.stem, []).append(entry)
    return [Submission(student, notebooks) for student, notebooks in found.items()]


class InvalidNotebook(ValueError):
    pass


def read_notebook(path):
    """The notebook at ``path``, or InvalidNotebook saying why it cannot be read."""
    try:
        return nbformat.read(path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - JSON, schema, encoding: all the same to a grader
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InvalidNotebook(f"not a readable notebook ({type(exc).__name__}: {first[:200]})") \
            from None


def recognise(nb, labs):
    """(Lab, None) for the lab ``nb`` is, or (None, why not)."""
    ids = {cell.get("id") for cell in nb.cells}
    headings = {ex for ex, _ in exercises_in(nb)}
    scores = {key: 2 * len(headings & set(lab.exercise_ids)) +
              len(ids & {c.id for c in lab.checks}) for key, lab in labs.items()}
    best = max(scores.values(), default=0)
    if best == 0:
        return None, "matches no lab: none of its headings or check cells is a lab's"
    winners = [key for key, score in scores.items() if score == best]
    if len(winners) > 1:
        return None, f"matches {' and '.join(winners)} equally"
    return labs[winners[0]], None


# ---- preparing one notebook -------------------------------------------------------------------
def _exercise_of_cells(nb):
    """[exercise id of the nearest heading above, or None] per cell."""
    found, exercise = [], None
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            headings = EXERCISE_HEADING.findall(cell.source)
            exercise = headings[-1][0] if headings else exercise
        found.append(exercise)
    return found


def _shown(source):
    """A check cell's source as the lab shows it (a copy of the solution keeps its hidden
    tests: they are not an edit)."""
    try:
        return strip_source(source, None, "check cell").strip()
    except LabGenError:
        return source.strip()


def _check_cell(check):
    cell = new_code_cell(check.source)
    cell.id = check.id
    cell.metadata["tags"] = ["check"]
    return cell


def prepare(nb, lab, parameters):
    """``nb`` made ready to grade (a new notebook), the ids of its restored check cells
    ({cell id: exercise}), and flags about what had to be put back."""
    nb = nbformat.from_dict(nbformat.reads(nbformat.writes(nb), as_version=4))
    flags, restored = [], {}
    for check in lab.checks:
        owner = _exercise_of_cells(nb)
        at = next((i for i, c in enumerate(nb.cells) if c.get("id") == check.id), None)
        if at is None:
            at = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                       and "check" in c.metadata.get("tags", []) and owner[i] == check.exercise
                       and c.get("id") not in restored), None)
        if at is not None:
            if _shown(nb.cells[at].source) != check.lab_source.strip():
                flags.append(f"the check cell of {check.exercise} was edited (graded as the "
                             f"lab has it)")
            nb.cells[at] = _check_cell(check)
        else:
            section = [i for i, ex in enumerate(owner) if ex == check.exercise]
            at = section[-1] + 1 if section else len(nb.cells)
            flags.append(f"the check cell of {check.exercise} was missing (put back)")
            nb.cells.insert(at, _check_cell(check))
        restored[check.id] = check.exercise
    params = new_code_cell("# Parameters set by the grader\n" + "\n".join(
        f"{name} = {value!r}" for name, value in parameters.items()))
    params.metadata["tags"] = ["injected-parameters"]
    at = next((i for i, c in enumerate(nb.cells)
               if "parameters" in c.metadata.get("tags", [])), None)
    if at is None:
        flags.append("no cell tagged 'parameters': the grader's parameters went first")
    nb.cells.insert(0 if at is None else at + 1, params)
    return nb, restored, flags
