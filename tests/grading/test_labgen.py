"""The lab generator: stubs, markers, cleared outputs, and labs/ kept up to date."""
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from course_lib.grading.labgen import LabGenError, exercises_in, generate, make_lab, strip_source

ROOT = Path(__file__).resolve().parents[2]
EX = ("Exercise 1.2", "ring all-reduce")


def test_solution_region_becomes_stub_at_its_indentation():
    src = "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n"
    assert strip_source(src, EX, "nb") == (
        "def f(x):\n    y = 1\n    raise NotImplementedError('Exercise 1.2: ring all-reduce')")


def test_hidden_tests_are_removed_and_markdown_answers_blanked():
    src = "check()\n### BEGIN HIDDEN TESTS\nsecret()\n### END HIDDEN TESTS\ndone()"
    assert strip_source(src, None, "nb") == "check()\ndone()"
    md = "Why?\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION"
    assert strip_source(md, EX, "nb", markdown=True) == "Why?\n_Your answer here._"


@pytest.mark.parametrize("src,message", [
    ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "cannot nest"),
    ("### BEGIN SOLUTION\n### BEGIN HIDDEN TESTS\n", "cannot nest"),
    ("x = 1\n### END SOLUTION\n", "without a matching"),
    ("### BEGIN SOLUTION\n### END HIDDEN TESTS\n", "without a matching"),
])
def test_malformed_markers_are_errors(src, message):
    with pytest.raises(LabGenError, match=message):
        strip_source(src, EX, "nb")


def test_solution_without_exercise_heading_is_an_error():
    nb = new_notebook(cells=[new_code_cell("### BEGIN SOLUTION\nx=1\n### END SOLUTION")])
    with pytest.raises(LabGenError, match="cell 0, line 1: a solution region with no"):
        make_lab(nb, "x.ipynb")


def test_make_lab_threads_exercise_ids_and_clears_outputs():
    code = new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION",
                         execution_count=3, outputs=[new_output("stream", text="hi")])
    code.metadata["tags"] = ["solution"]
    code.metadata["execution"] = {"iopub.status.busy": "2026"}
    nb = new_notebook(cells=[new_markdown_cell("## Exercise 3.1: first one"), code,
                             new_markdown_cell("### Exercise 3.2 - second"),
                             new_code_cell("### BEGIN SOLUTION\ny = 2\n### END SOLUTION")])
    nb.metadata["kernelspec"] = {"name": "my-env", "display_name": "mine"}
    lab = make_lab(nb)
    assert lab.cells[1].source == "def f():\n    raise NotImplementedError('Exercise 3.1: first one')"
    assert lab.cells[1].outputs == [] and lab.cells[1].execution_count is None
    assert lab.cells[1].metadata == {"tags": ["solution"]}
    assert lab.cells[3].source == "raise NotImplementedError('Exercise 3.2: second')"
    assert lab.metadata["kernelspec"]["name"] == "python3"
    assert exercises_in(lab) == [("Exercise 3.1", "first one"), ("Exercise 3.2", "second")]
    assert nb.cells[1].outputs  # the source notebook is left alone


def test_a_prediction_threads_its_own_id_through_the_stub():
    nb = new_notebook(cells=[
        new_markdown_cell("### Prediction 4.1: the bubble of GPipe"),
        new_code_cell("def bubble(p, m):\n    ### BEGIN SOLUTION\n    return (p - 1) / (m + p - 1)\n"
                      "    ### END SOLUTION"),
        new_markdown_cell("### Exercise 4.1: GPipe"),
        new_code_cell("### BEGIN SOLUTION\ny = 2\n### END SOLUTION")])
    lab = make_lab(nb)
    assert lab.cells[1].source == ("def bubble(p, m):\n"
                                   "    raise NotImplementedError('Prediction 4.1: the bubble of GPipe')")
    assert lab.cells[3].source == "raise NotImplementedError('Exercise 4.1: GPipe')"
    assert exercises_in(lab) == [("Prediction 4.1", "the bubble of GPipe"), ("Exercise 4.1", "GPipe")]


def test_generate_writes_then_reports_nothing_stale(tmp_path):
    sol, labs = tmp_path / "solutions", tmp_path / "labs"
    sol.mkdir()
    nb = new_notebook(cells=[new_markdown_cell("# Exercise 9.1: x"),
                             new_code_cell("### BEGIN SOLUTION\nx=1\n### END SOLUTION")])
    nbformat.write(nb, sol / "09_x.ipynb")
    labs.mkdir()
    (labs / "08_orphan.ipynb").write_text("{}")
    assert generate(sol, labs, check=True) == [labs / "09_x.ipynb", labs / "08_orphan.ipynb"]
    generate(sol, labs)
    assert generate(sol, labs, check=True) == []
    assert not (labs / "08_orphan.ipynb").exists()


def test_committed_labs_are_what_the_generator_writes():
    stale = generate(ROOT / "solutions", ROOT / "labs", check=True)
    assert stale == [], f"labs/ is out of date, run `make labs`: {stale}"


def test_committed_labs_hold_no_solutions_or_outputs():
    for path in sorted((ROOT / "labs").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        text = path.read_text()
        assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text, path
        assert nb.metadata["kernelspec"]["name"] == "python3"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path
        solution = nbformat.read(ROOT / "solutions" / path.name, as_version=4)
        for ex_id, title in exercises_in(solution):
            assert f"NotImplementedError('{ex_id}: {title}')" in text, (path, ex_id)


def test_every_solution_notebook_has_papermill_parameters():
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(params) == 1, path
        for name in ("NPROC", "BACKEND", "QUICK", "OUTPUT_DIR"):
            assert f"{name}:" in params[0].source, (path, name)
        assert nb.metadata["kernelspec"]["name"] == "python3"


def test_every_exercise_has_a_check_cell():
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        checks = [c.source for c in nb.cells if "check" in c.metadata.get("tags", [])]
        exercises = exercises_in(nb)
        assert exercises, path
        assert len(checks) == len(exercises), path
