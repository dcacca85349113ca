"""The solutions as nbgrader source notebooks: nbgrader's own preprocessors, with their
default settings, make of each one the lab we generate (up to the stub's wording), and
`nbgrader generate_assignment` releases one."""
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.grading.labgen import grade_id, make_lab, nbgrader_cells, stamp_nbgrader

nbgrader = pytest.importorskip("nbgrader", reason="nbgrader is not installed (pip install nbgrader)")

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
OUR_STUB = re.compile(r"^(\s*)raise NotImplementedError\('(?:Exercise|Prediction) \d+\.\d+: .*'\)$",
                      re.M)
THEIR_STUB = re.compile(r"^(\s*)# YOUR CODE HERE\n\1raise NotImplementedError\(\)$", re.M)


def normalised(source):
    source = OUR_STUB.sub(r"\1<stub>", source)
    source = THEIR_STUB.sub(r"\1<stub>", source)
    source = source.replace("_Your answer here._", "<stub>").replace("YOUR ANSWER HERE", "<stub>")
    return source.rstrip()  # labgen drops a cell's final newline


def nbgrader_release(path):
    """What `nbgrader generate_assignment` does to the cells, with its default settings."""
    from nbgrader.preprocessors import (CheckCellMetadata, ClearHiddenTests, ClearOutput,
                                        ClearSolutions, ComputeChecksums, LockCells)

    nb, resources = nbformat.read(path, as_version=4), {}
    for step in (LockCells, ClearSolutions, ClearOutput, CheckCellMetadata, ComputeChecksums,
                 ClearHiddenTests, ComputeChecksums, CheckCellMetadata):
        nb, resources = step().preprocess(nb, resources)
    return nb


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_nbgrader_makes_our_lab_of_every_solution(path):
    released = nbgrader_release(path)
    # what `make labs` writes (test_labgen checks that labs/ holds exactly that)
    lab = make_lab(nbformat.read(path, as_version=4), path.name)
    assert [c.cell_type for c in released.cells] == [c.cell_type for c in lab.cells]
    stubs = 0
    for theirs, ours in zip(released.cells, lab.cells):
        assert normalised(theirs.source) == normalised(ours.source), theirs.source[:200]
        stubs += normalised(ours.source).count("<stub>")
    solution = nbformat.read(path, as_version=4)
    assert stubs == sum(c.source.count("### BEGIN SOLUTION") for c in solution.cells) > 0
    for theirs, ours in zip(released.cells, solution.cells):
        meta = theirs.metadata.get("nbgrader", {})
        if "check" in ours.metadata.get("tags", []):  # graded, and students cannot edit it
            assert meta["grade"] and meta["locked"] and meta["points"] == 1
        if "### BEGIN SOLUTION" in ours.source:
            assert meta["solution"] and not meta["locked"]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_metadata_is_up_to_date(path):
    assert not stamp_nbgrader(path, check=True), \
        f"run: python -m course_lib.grading.labgen --nbgrader solutions ({path.name})"


def test_grade_ids_are_the_exercise_ids():
    nb = nbformat.read(SOLUTIONS[0], as_version=4)
    ids = [m["grade_id"] for m in nbgrader_cells(nb) if m]
    assert grade_id("Exercise 0.1") == "exercise_0_1"
    assert "exercise_0_1" in ids and "exercise_0_1_solution" in ids
    assert len(ids) == len(set(ids))


def test_stamping_touches_only_cell_metadata(tmp_path):
    copy = tmp_path / SOLUTIONS[0].name
    nb = nbformat.read(SOLUTIONS[0], as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("nbgrader", None)
    nbformat.write(nb, copy)
    assert stamp_nbgrader(copy) and not stamp_nbgrader(copy, check=True)
    again = nbformat.read(copy, as_version=4)
    assert [c.source for c in again.cells] == [c.source for c in nb.cells]
    assert [{k: v for k, v in c.metadata.items() if k != "nbgrader"} for c in again.cells] == \
        [dict(c.metadata) for c in nb.cells]
    assert copy.read_text() == SOLUTIONS[0].read_text()


@pytest.mark.slow
def test_nbgrader_generate_assignment_accepts_a_lab(tmp_path):
    """A course on nbgrader takes a solution as a source notebook, as it comes."""
    source = tmp_path / "source" / "lab00"
    source.mkdir(parents=True)
    (source / SOLUTIONS[0].name).write_bytes(SOLUTIONS[0].read_bytes())
    done = subprocess.run([sys.executable, "-m", "nbgrader", "generate_assignment", "lab00",
                           "--CourseDirectory.root=" + str(tmp_path), "--force"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          # nbgrader runs alembic, installed beside this interpreter
                          env={**os.environ, "PATH": f"{Path(sys.executable).parent}:"
                                                     f"{os.environ.get('PATH', '')}"})
    assert done.returncode == 0, done.stderr[-3000:]
    released = nbformat.read(tmp_path / "release" / "lab00" / SOLUTIONS[0].name, as_version=4)
    text = nbformat.writes(released)
    assert "BEGIN SOLUTION" not in text and "raise NotImplementedError()" in text


def test_labs_drop_the_metadata_and_hidden_tests_the_grader_keeps():
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    check = new_code_cell("check(f)\n### BEGIN HIDDEN TESTS\nsecret(f)\n### END HIDDEN TESTS")
    check.metadata["tags"] = ["check"]
    nb = new_notebook(cells=[new_markdown_cell("## Exercise 4.2: f"),
                             new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n"
                                           "    ### END SOLUTION"), check])
    for cell, meta in zip(nb.cells, nbgrader_cells(nb)):
        if meta:
            cell.metadata["nbgrader"] = meta
    assert nb.cells[2].metadata["nbgrader"]["grade_id"] == "exercise_4_2"
    assert nb.cells[1].metadata["nbgrader"]["grade_id"] == "exercise_4_2_solution"
    lab, grading = make_lab(nb), make_lab(nb, keep_hidden=True)
    assert all("nbgrader" not in c.metadata for c in lab.cells)
    assert lab.cells[2].source == "check(f)"
    assert grading.cells[2].source == "check(f)\nsecret(f)"


def test_an_exercise_whose_check_cell_lacks_the_tag_is_refused():
    from course_lib.grading.labgen import LabGenError

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("### Exercise 9.1: x"),
                nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n"
                                          "    ### END SOLUTION"),
                nbformat.v4.new_code_cell("lab09.check_f(f)")]  # no 'check' tag
    with pytest.raises(LabGenError, match="Exercise 9.1 has a solution cell but no cell tagged"):
        nbgrader_cells(nb, "09_x.ipynb")
    nb.cells[2].metadata["tags"] = ["check"]
    assert nbgrader_cells(nb, "09_x.ipynb")[2]["grade"] is True
