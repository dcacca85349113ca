"""The gradebook on real notebooks executed by a real kernel."""
import csv
import shutil
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course_lib.grading import gradebook as grade
from course_lib.grading.labgen import exercises_in, make_lab

ROOT = Path(__file__).resolve().parents[2]


def check_cell(ex, expr):
    cell = new_code_cell(f"from course_lib.grading import checks\nassert {expr}, 'wrong'\n"
                         f"checks.passed('Exercise {ex}')")
    cell.metadata["tags"] = ["check"]
    return cell


@pytest.fixture
def course(tmp_path):
    nb = new_notebook(cells=[
        new_markdown_cell("## Exercise 7.1: double"),
        new_code_cell("def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION"),
        check_cell("7.1", "double(2) == 4"),
        new_markdown_cell("## Exercise 7.2: square"),
        new_code_cell("def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION"),
        check_cell("7.2", "square(3) == 9"),
    ])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    nbformat.write(nb, solutions / "07_demo.ipynb")
    lab = make_lab(nb)
    subs = tmp_path / "submissions"
    for student in ("alice", "bob", "mallory"):
        (subs / student).mkdir(parents=True)
    nbformat.write(nb, subs / "alice" / "07_demo.ipynb")  # full marks
    half = make_lab(nb)
    half.cells[4].source = "def square(x):\n    return x ** 2"
    nbformat.write(half, subs / "bob" / "07_demo.ipynb")  # one of two
    cheat = make_lab(nb)
    cheat.cells[2].source = "print('✓ Exercise 7.1 passed')"  # edits the check: restored
    nbformat.write(cheat, subs / "mallory" / "07_demo.ipynb")
    return solutions, subs, lab


def test_gradebook_rows_and_columns(course, tmp_path):
    solutions, subs, _ = course
    out = tmp_path / "gradebook.csv"
    assert grade.main([str(subs), "--solutions", str(solutions), "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == ["student", "Exercise 7.1", "Exercise 7.2", "total"]
    table = {r["student"]: (r["Exercise 7.1"], r["Exercise 7.2"], r["total"]) for r in rows}
    assert table == {"alice": ("1", "1", "2"), "bob": ("0", "1", "1"), "mallory": ("0", "0", "0")}


def test_missing_folder_is_an_error(tmp_path):
    assert grade.main([str(tmp_path / "none")]) == 2


def stub_run_cells(solution, lab):
    """The lab cut to what its checks need: markdown (it names the exercises), the
    parameters and the setup cell after them (imports), every cell that only defines
    (functions, classes, imports), the exercise cells and the check cells. The demos
    and measurements are left out: nbval runs them, once, on the solutions."""
    code = [i for i, c in enumerate(lab.cells) if c.cell_type == "code"]
    params = next(i for i in code if "parameters" in lab.cells[i].metadata.get("tags", []))
    setup = next(i for i in code if i > params)
    kept = []
    for i, (sol, cell) in enumerate(zip(solution.cells, lab.cells)):
        defines = cell.cell_type == "code" and all(
            not line or line[0] in " #)]}" or line.startswith(("def ", "class ", "import ",
                                                                 "from ", "@"))
            for line in cell.source.splitlines())
        if (cell.cell_type == "markdown" or i in (params, setup) or defines
                or "check" in cell.metadata.get("tags", []) or "### BEGIN SOLUTION" in sol.source):
            kept.append(cell)
    lab.cells = kept
    return lab


@pytest.mark.notebook
@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "labs").glob("[0-9][0-9]_*.ipynb")))
def test_lab_stubs_fail_their_checks_with_not_implemented(name, tmp_path):
    """Each generated lab, run as a student would before writing anything: every
    check cell fails with NotImplementedError naming its exercise."""
    sub = tmp_path / name
    solution = nbformat.read(ROOT / "solutions" / name, as_version=4)
    lab = make_lab(solution)
    nbformat.write(stub_run_cells(solution, nbformat.read(ROOT / "labs" / name, as_version=4)),
                   sub)
    nb, check_ids = grade.execute_submission(sub, lab)
    assert grade.passed_exercises(nb, check_ids) == set()
    errors = {}
    for cell in nb.cells:
        if cell.get("id") in check_ids:
            (err,) = [o for o in cell.outputs if o.output_type == "error"]
            errors[err.evalue.split(" is not")[0].split(":")[0]] = err.ename
    assert errors == {ex: "NotImplementedError" for ex, _ in exercises_in(solution)}


def executed(cells):
    """A notebook as if run: (cell, stdout text or None) pairs."""
    from nbformat.v4 import new_output

    nb = new_notebook()
    for cell, text in cells:
        if text is not None:
            cell.outputs = [new_output("stream", name="stdout", text=text)]
        nb.cells.append(cell)
    return nb


def test_a_pass_counts_only_from_its_own_check_cell_as_a_whole_line():
    check_71, check_72 = check_cell("7.1", "True"), check_cell("7.2", "True")
    student_72 = new_code_cell("print('✓ Exercise 7.1 passed')")  # a forged line
    nb = executed([
        (new_markdown_cell("## Exercise 7.1: double"), None),
        (new_code_cell("def double(x): return x"), None),
        (check_71, "wrong answer\n"),
        (new_markdown_cell("## Exercise 7.2: square"), None),
        (student_72, "✓ Exercise 7.1 passed\n"),
        (check_72, "✓ Exercise 7.1 passed\nnot quite ✓ Exercise 7.2 passed\n"),
    ])
    assert grade.passed_exercises(nb, {check_71.id, check_72.id}) == set()
    check_72.outputs[0].text = "details...\n✓ Exercise 7.2 passed (world sizes 2 and 3)\n"
    assert grade.passed_exercises(nb, {check_71.id, check_72.id}) == {"Exercise 7.2"}
