"""The gradebook on real notebooks: each submission's code in a sandbox of its own, each
check decided by the judge. (A whole class, tamperings included: test_class.py.)"""
import csv
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import gradebook as grade
from course_lib.grading.labgen import exercises_in, make_lab
from mini_lab import CELL, edited, mini_solution, put, write_course

ROOT = Path(__file__).resolve().parents[2]


def rows_of(out):
    return {r["student"]: r for r in csv.DictReader(Path(out).open())}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """A solved, an untouched and a check-editing submission, graded once (checks only)."""
    root = tmp_path_factory.mktemp("course")
    solutions, lab = write_course(root)
    subs = root / "submissions"
    put(subs / "alice" / "00_mini.ipynb", mini_solution())
    put(subs / "bob.ipynb", lab)
    put(subs / "mallory" / "mine.ipynb",
        edited(lab, check02="print('✓ Exercise 0.2 passed')"))
    out = root / "grades" / "gradebook.csv"
    assert grade.main([str(subs), "--solutions", str(solutions), "--out", str(out)]) == 0
    return {"rows": rows_of(out), "out": out.parent,
            "details": list(csv.DictReader((out.parent / "gradebook.details.csv").open()))}


def test_one_row_per_student_a_column_per_exercise(graded):
    rows = graded["rows"]
    assert list(rows["alice"]) == ["student", "Exercise 0.2", "Exercise 0.3", "Exercise 3.3",
                                   "total", "status", "flags"]
    assert {s: (r["Exercise 0.2"], r["Exercise 0.3"], r["Exercise 3.3"], r["total"])
            for s, r in rows.items()} == {"alice": ("1", "1", "1", "3"),
                                          "bob": ("0", "0", "0", "0"),
                                          "mallory": ("0", "0", "0", "0")}
    assert rows["alice"]["status"] == "ok" and rows["alice"]["flags"] == ""
    assert "the check cell of Exercise 0.2 was edited" in rows["mallory"]["flags"]
    messages = {(d["student"], d["exercise"]): (d["status"], d["message"])
                for d in graded["details"]}
    assert messages[("alice", "Exercise 3.3")][1].startswith("✓ Exercise 3.3 passed")
    assert messages[("bob", "Exercise 0.3")] == (
        "fail", "Exercise 0.3 is not implemented yet: replace the `raise NotImplementedError` "
                "in its code cell with your solution, run that cell, then this one.")


def test_two_judges_never_share_an_interpreter():
    """With --jobs above 1 each judge is a process of its own (CPython 3.11's AST
    constructor is not safe across threads: gh-106905), spawned rather than forked."""
    import os

    with grade._judges(2) as pool:
        pids = {pool.submit(os.getpid).result() for _ in range(4)}
        assert pool._mp_context.get_start_method() == "spawn"
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_checks_only_runs_what_the_checks_need_and_keeps_the_notebook_as_it_ran(graded):
    outputs = graded["out"] / "outputs" / "alice" / "00_mini"
    assert (outputs / "written.txt").exists()  # the setup cell ran, writing here
    assert not (outputs / "demo.txt").exists()  # the demo did not
    executed = nbformat.read(graded["out"] / "executed" / "alice" / "00_mini.ipynb", 4)
    check = next(c for c in executed.cells if c.get("id") == f"mini-{CELL['check03']:02d}")
    assert check.outputs[0]["text"].startswith("✓ Exercise 0.3 passed")
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)


@pytest.mark.notebook
@pytest.mark.slow  # a whole notebook in a sandbox: `make test-slow`
def test_full_runs_every_cell_and_keeps_its_outputs(tmp_path):
    solutions, _ = write_course(tmp_path)
    put(tmp_path / "subs" / "alice.ipynb", mini_solution())
    out = tmp_path / "grades" / "gradebook.csv"
    assert grade.main([str(tmp_path / "subs"), "--solutions", str(solutions), "--out", str(out),
                       "--full"]) == 0
    assert rows_of(out)["alice"]["total"] == "3"
    assert (tmp_path / "grades" / "outputs" / "alice" / "alice" / "demo.txt").exists()
    executed = nbformat.read(tmp_path / "grades" / "executed" / "alice" / "alice.ipynb", 4)
    demo = executed.cells[CELL["demo"] + 1]  # after the grader's parameters
    assert demo.outputs[0]["text"] == "a demo: only a full run shows it\n"


def test_missing_folder_is_an_error(tmp_path):
    assert grade.main([str(tmp_path / "none")]) == 2


# three labs here, all seven in `make test-slow` (a sandbox each, ~4 s)
@pytest.mark.parametrize("name", [
    name if name[:2] in ("00", "02", "04") else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(p.name for p in (ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))])
def test_each_lab_untouched_scores_nothing_and_says_what_is_missing(name, tmp_path):
    """Every generated lab graded as handed out: each exercise fails, not implemented."""
    (tmp_path / "subs").mkdir()
    (tmp_path / "subs" / "student.ipynb").write_bytes((ROOT / "labs" / name).read_bytes())
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    (solutions / name).write_bytes((ROOT / "solutions" / name).read_bytes())
    out = tmp_path / "grades" / "gradebook.csv"
    assert grade.main([str(tmp_path / "subs"), "--solutions", str(solutions),
                       "--out", str(out)]) == 0
    details = list(csv.DictReader((out.parent / "gradebook.details.csv").open()))
    exercises = [ex for ex, _ in exercises_in(nbformat.read(solutions / name, 4))]
    assert [d["exercise"] for d in details] == exercises
    assert all(d["status"] == "fail" and "is not implemented yet" in d["message"]
               for d in details), details
    row = rows_of(out)["student"]
    assert row["total"] == "0" and row["status"] == "ok" and row["flags"] == ""


@pytest.mark.slow  # `make test-slow`
def test_the_gradebook_keeps_the_rows_written_before_a_stop(tmp_path, monkeypatch):
    """Rows are appended as students finish: a grader stopped half-way (here, by a
    KeyboardInterrupt while grading the second student) leaves a valid CSV of the first."""
    solutions, lab = write_course(tmp_path)
    for student in ("ann", "ben", "cat"):
        put(tmp_path / "subs" / f"{student}.ipynb", lab)
    real, calls = grade.grade_file, []

    def stop_at_the_second(student, *args, **kwargs):
        calls.append(student)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(student, *args, **kwargs)

    monkeypatch.setattr(grade, "grade_file", stop_at_the_second)
    out = tmp_path / "gb.csv"
    with pytest.raises(KeyboardInterrupt):
        grade.gradebook(tmp_path / "subs", solutions, out)
    assert [(r["student"], r["total"]) for r in csv.DictReader(out.open())] == [("ann", "0")]


def test_grading_refuses_to_write_into_the_submissions_folder(tmp_path):
    solutions, lab = write_course(tmp_path)
    subs = tmp_path / "subs"
    put(subs / "alice" / "lab.ipynb", lab)
    with pytest.raises(ValueError, match="inside the submissions folder"):
        grade.gradebook(subs, solutions, subs / "gradebook.csv")
    assert grade.main([str(subs), "--solutions", str(solutions),
                       "--out", str(subs / "alice" / "gb.csv")]) == 2


def test_flags_stay_whole_whatever_they_contain(tmp_path):
    """A flag with commas, semicolons and parentheses is one flag in the CSV (one line
    each) and one item on the feedback page."""
    from course_lib.grading.book import Book
    from course_lib.grading.gradebook import Graded

    flag = "cell 3: calls setattr on course_lib (before the check, of Exercise 0.2; undone)"
    book = Book(tmp_path / "gb.csv", tmp_path, ["Exercise 0.2"])
    book.add("ann", [Graded("ann", "lab.ipynb", "00", flags=[flag, "unsandboxed: a, b (c)"])])
    row = rows_of(tmp_path / "gb.csv")["ann"]
    assert row["flags"].split("\n") == ["lab.ipynb: " + flag, "lab.ipynb: unsandboxed: a, b (c)"]
    page = (tmp_path / "feedback" / "ann.md").read_text()
    assert f"- lab.ipynb: {flag}\n" in page and page.count("\n- ") == 2


def test_merge_combines_slices_and_refuses_a_student_twice(tmp_path):
    head = "student,Exercise 0.2,Exercise 0.10,total,status,flags\n"
    (tmp_path / "a.csv").write_text(head + "bo,1,0,1,ok,\n")
    (tmp_path / "a.details.csv").write_text(",".join(grade.DETAILS) +
                                            "\nbo,x.ipynb,00,Exercise 0.2,pass,ok,1.0\n")
    (tmp_path / "b.csv").write_text("student,Exercise 0.3,Exercise 0.2,total,status,flags\n"
                                    "al,1,1,2,ok,\n")
    columns, _ = grade.merge([tmp_path / "b.csv", tmp_path / "a.csv", tmp_path / "a.details.csv"],
                             tmp_path / "all.csv")
    assert columns == ["Exercise 0.2", "Exercise 0.3", "Exercise 0.10"]
    rows = list(csv.DictReader((tmp_path / "all.csv").open()))
    assert [(r["student"], r["Exercise 0.3"], r["Exercise 0.10"], r["total"]) for r in rows] == [
        ("al", "1", "0", "2"), ("bo", "0", "0", "1")]
    assert len(list(csv.DictReader((tmp_path / "all.details.csv").open()))) == 1
    (tmp_path / "c.csv").write_text(head + "al,1,0,1,ok,\n")
    assert grade.main(["merge", str(tmp_path / "b.csv"), str(tmp_path / "c.csv"),
                       "--out", str(tmp_path / "x.csv")]) == 2


def test_the_generated_lab_is_what_students_get(tmp_path):
    """The mini lab is a lab like the others: labgen stubs its exercises."""
    lab = make_lab(mini_solution())
    assert "raise NotImplementedError('Exercise 0.3: ring shift')" in \
        lab.cells[CELL["ring_shift"]].source


def test_every_lab_has_a_typical_grading_time_to_order_the_work_by():
    labs = sorted(p.name[:2] for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(grade.TYPICAL_S) == labs
