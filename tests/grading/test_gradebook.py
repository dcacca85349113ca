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
    assert list(rows[0]) == ["student", "Exercise 7.1", "Exercise 7.2", "total", "status", "flags"]
    table = {r["student"]: (r["Exercise 7.1"], r["Exercise 7.2"], r["total"]) for r in rows}
    assert table == {"alice": ("1", "1", "2"), "bob": ("0", "1", "1"), "mallory": ("0", "0", "0")}
    assert "check cell of Exercise 7.1 was edited" in next(r for r in rows
                                                           if r["student"] == "mallory")["flags"]


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


# ---- a class of submissions, graded once: every way a notebook can go wrong -------------------
TOKEN_RING = '''def token_ring(token):
    rank, world = dist.get_rank(), dist.get_world_size()
    ### BEGIN SOLUTION
    right, left = (rank + 1) % world, (rank - 1) % world
    if rank == 0:
        comm.send(token, right)
        back = torch.empty_like(token)
        comm.recv(back, left)
        return back
    received = torch.empty_like(token)
    comm.recv(received, left)
    comm.send(received + rank, right)
    return received + rank
    ### END SOLUTION'''
RING_SHIFT = '''def ring_shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    ### BEGIN SOLUTION
    out = torch.empty_like(x)
    comm.exchange(sends=[(x, (rank + 1) % world)], recvs=[(out, (rank - 1) % world)])
    return out
    ### END SOLUTION'''
DOUBLE_CHECK = '''with checks.in_process("Exercise 0.9", double):
    checks.expect_equal("Exercise 0.9", double(3), 6, rank=0, world_size=1, what="double(3)")
    ### BEGIN HIDDEN TESTS
    checks.expect_equal("Exercise 0.9", double(-5), -10, rank=0, world_size=1, what="double(-5)")
    ### END HIDDEN TESTS
checks.passed("Exercise 0.9")'''
SETUP = '''import os
import time

import torch
import torch.distributed as dist

from course_lib import comm, run
from course_lib.grading import checks, lab00

os.makedirs(OUTPUT_DIR, exist_ok=True)
with open(os.path.join(OUTPUT_DIR, "written.txt"), "w") as f:
    f.write("a notebook writes here")'''
# cells of the mini lab, by name, so that submissions can say which cell they change
MINI = ["title", "params", "setup", "h02", "token_ring", "check02", "h03", "ring_shift",
        "check03", "h09", "double", "check09"]
CELL = {name: i for i, name in enumerate(MINI)}
TIMEOUT, CELL_TIMEOUT = 150, 25


def mini_solution():
    cells = [new_markdown_cell("# A mini lab: two exercises on ranks, one in the kernel"),
             new_code_cell('NPROC: int = 2\nBACKEND: str = "auto"\nQUICK: bool = True\n'
                           'OUTPUT_DIR: str = "../runs/latest"'),
             new_code_cell(SETUP),
             new_markdown_cell("### Exercise 0.2: token ring"), new_code_cell(TOKEN_RING),
             new_code_cell("lab00.check_token_ring(token_ring, world_sizes=(2,))"),
             new_markdown_cell("### Exercise 0.3: ring shift"), new_code_cell(RING_SHIFT),
             new_code_cell("lab00.check_ring_shift(ring_shift, world_sizes=(2,), timeout=10)"),
             new_markdown_cell("### Exercise 0.9: double"),
             new_code_cell("def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n"
                           "    ### END SOLUTION"),
             new_code_cell(DOUBLE_CHECK)]
    cells[CELL["params"]].metadata["tags"] = ["parameters"]
    for name in ("check02", "check03", "check09"):
        cells[CELL[name]].metadata["tags"] = ["check"]
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def edited(nb, after=None, **sources):
    """A copy of ``nb`` with cells replaced ({name: source}) and new cells inserted
    ({name of the cell they follow: source}, in ``after``)."""
    nb = nbformat.from_dict(nbformat.reads(nbformat.writes(nb), as_version=4))
    for name, source in sources.items():
        nb.cells[CELL[name]].source = source
    for name, source in sorted((after or {}).items(), key=lambda kv: -CELL[kv[0]]):
        nb.cells.insert(CELL[name] + 1, new_code_cell(source))
    return nb


WRONG_SHIFT = "def ring_shift(x):\n    return x.clone()  # no message at all"
DEADLOCKING_SHIFT = '''def ring_shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.empty_like(x)
    comm.send(x, (rank + 1) % world)  # every rank sends first: nobody receives
    comm.recv(out, (rank - 1) % world)
    return out'''
HANGING_RUN = '''def hang():
    dist.barrier() if dist.get_rank() == 0 else time.sleep(3600)

run(hang, nproc=2, timeout=3600)  # the student's own experiment, left running'''
IGNORES_INTERRUPT = '''import signal
signal.signal(signal.SIGINT, signal.SIG_IGN)
while True:
    time.sleep(1)'''


def write_class(solution, lab, subs):
    """The submissions: {student: what the gradebook must say}."""
    def put(path, nb):
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, path)

    put(subs / "solved" / "00_mini.ipynb", solution)
    put(subs / "flat.ipynb", solution)  # flat layout, recognised by content
    put(subs / "stub.ipynb", lab)
    put(subs / "wrong" / "mine.ipynb", edited(
        solution, token_ring=TOKEN_RING.replace("received + rank", "received + rank + 1"),
        ring_shift=WRONG_SHIFT, double="def double(x):\n    return 6 if x == 3 else x"))
    put(subs / "deadlock" / "00_mini.ipynb", edited(solution, ring_shift=DEADLOCKING_SHIFT,
                                                    after={"setup": HANGING_RUN}))
    put(subs / "stuck" / "00_mini.ipynb", edited(solution, after={"check02": IGNORES_INTERRUPT}))
    put(subs / "crash" / "00_mini.ipynb", edited(solution, after={"check03": "os._exit(3)"}))
    (subs / "broken").mkdir()
    (subs / "broken" / "00_mini.ipynb").write_text('{"cells": [ not json')
    other = new_notebook(cells=[new_markdown_cell("### Exercise 5.1: another lab"),
                                new_code_cell("x = 1")])
    put(subs / "other.ipynb", other)
    put(subs / "tamper_import" / "00_mini.ipynb", edited(
        solution, ring_shift="from course_lib.collectives.p2p import ring_shift"))
    put(subs / "tamper_noop" / "00_mini.ipynb", edited(
        solution, ring_shift=WRONG_SHIFT, double="def double(x):\n    return 0",
        after={"setup": "checks.expect_close = lambda *a, **k: None\n"
                        "checks.expect_equal = lambda *a, **k: None\n"
                        "torch.testing.assert_close = lambda *a, **k: None"}))
    put(subs / "tamper_patch" / "00_mini.ipynb", edited(
        lab, ring_shift=lab.cells[CELL["ring_shift"]].source +
        "\n\nlab00.check_ring_shift = lambda *a, **k: print('✓ Exercise 0.3 passed')"))
    put(subs / "tamper_print" / "00_mini.ipynb", edited(
        lab, after={"double": "print('✓ Exercise 0.2 passed')\nprint('✓ Exercise 0.9 passed')"}))
    put(subs / "tamper_edit" / "00_mini.ipynb", edited(
        lab, check09="print('✓ Exercise 0.9 passed')"))
    put(subs / "tamper_during" / "00_mini.ipynb", edited(
        solution, double="def double(x):\n    checks.expect_equal = lambda *a, **k: None\n"
                         "    return 6 if x == 3 else 0"))


def tree(folder):
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*"))}


# Grading the class takes ~100 s of kernels and ranks: `make test-slow` runs these (CI runs
# it after `make test`), so that `make test` stays under its 20 minutes.
SLOW_CLASS = pytest.mark.slow


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    """The class graded once, two notebooks at a time, as `make grade` would."""
    import time

    root = tmp_path_factory.mktemp("class")
    solutions, subs, out = root / "solutions", root / "submissions", root / "grades"
    solutions.mkdir()
    solution = mini_solution()
    nbformat.write(solution, solutions / "00_mini.ipynb")
    write_class(solution, make_lab(solution), subs)
    before = tree(subs)
    started = time.monotonic()
    code = grade.main([str(subs), "--solutions", str(solutions), "--out", str(out / "gradebook.csv"),
                       "--timeout", str(TIMEOUT), "--cell-timeout", str(CELL_TIMEOUT), "--jobs", "2"])
    print(f"graded {len(list(subs.iterdir()))} submissions in {time.monotonic() - started:.0f} s")
    assert code == 0
    rows = {r["student"]: r for r in csv.DictReader((out / "gradebook.csv").open())}
    details = list(csv.DictReader((out / "gradebook.details.csv").open()))
    return {"rows": rows, "details": details, "out": out, "subs": subs, "before": before}


def scores(row):
    return tuple(int(row[ex]) for ex in ("Exercise 0.2", "Exercise 0.3", "Exercise 0.9"))


def result(graded, student, exercise):
    (found,) = [(d["status"], d["message"]) for d in graded["details"]
                if d["student"] == student and d["exercise"] == exercise]
    return found


@pytest.mark.notebook
@SLOW_CLASS
def test_every_student_gets_one_row_with_the_right_scores(graded_class):
    rows = graded_class["rows"]
    assert list(next(iter(rows.values()))) == ["student", "Exercise 0.2", "Exercise 0.3",
                                               "Exercise 0.9", "total", "status", "flags"]
    assert {s: scores(r) for s, r in rows.items()} == {
        "solved": (1, 1, 1), "flat": (1, 1, 1), "stub": (0, 0, 0), "wrong": (0, 0, 0),
        "deadlock": (1, 0, 1), "stuck": (1, 0, 0), "crash": (1, 1, 0), "broken": (0, 0, 0),
        "other": (0, 0, 0), "tamper_import": (1, 0, 1), "tamper_noop": (1, 0, 0),
        "tamper_patch": (0, 0, 0), "tamper_print": (0, 0, 0), "tamper_edit": (0, 0, 0),
        "tamper_during": (1, 1, 0)}
    assert all(int(r["total"]) == sum(scores(r)) for r in rows.values())
    assert rows["solved"]["status"] == "ok" and rows["solved"]["flags"] == ""
    assert rows["flat"]["status"] == "ok"


@pytest.mark.notebook
@SLOW_CLASS
def test_wrong_answers_fail_their_checks_hidden_tests_included(graded_class):
    assert result(graded_class, "wrong", "Exercise 0.2")[0] == "fail"
    status, message = result(graded_class, "wrong", "Exercise 0.3")
    assert status == "fail" and message.startswith("Exercise 0.3: rank 0 of world size 2")
    # passes the visible case, double(3) == 6; the hidden one, double(-5), catches it
    status, message = result(graded_class, "wrong", "Exercise 0.9")
    assert status == "fail" and "double(-5)" in message
    status, message = result(graded_class, "stub", "Exercise 0.3")
    assert status == "fail" and "not implemented yet" in message


@pytest.mark.notebook
@SLOW_CLASS
def test_hangs_crashes_and_bad_files_get_a_row_that_says_so(graded_class):
    rows = graded_class["rows"]
    # a check whose code deadlocks is stopped by the launcher and fails with the hang
    status, message = result(graded_class, "deadlock", "Exercise 0.3")
    assert status == "fail" and "did not finish in 10s" in message
    # the student's own job that hangs in a cell is interrupted; the notebook goes on
    assert f"ok (cell 5 stopped after {CELL_TIMEOUT} s" in rows["deadlock"]["status"]
    # a cell that ignores the interrupt: the notebook is stopped, later checks time out
    assert "timeout" in rows["stuck"]["status"]
    assert result(graded_class, "stuck", "Exercise 0.9")[0] == "timeout"
    assert "crashed" in rows["crash"]["status"] and "kernel died" in rows["crash"]["status"]
    assert result(graded_class, "crash", "Exercise 0.9") == (
        "error", "not run: the kernel died in cell 11")
    assert "invalid notebook" in rows["broken"]["status"]
    assert "JSON" in rows["broken"]["status"] or "json" in rows["broken"]["status"]
    assert "wrong lab" in rows["other"]["status"] and "matches no lab" in rows["other"]["status"]


@pytest.mark.notebook
@SLOW_CLASS
def test_each_tampering_is_undone_or_refused_and_flagged(graded_class):
    rows = graded_class["rows"]
    status, message = result(graded_class, "tamper_import", "Exercise 0.3")
    assert status == "fail" and "course_lib's own implementation" in message
    assert "course_lib.collectives.p2p.ring_shift" in message
    assert "imports ring_shift from course_lib.collectives.p2p" in rows["tamper_import"]["flags"]
    noop = rows["tamper_noop"]["flags"]
    assert "assigns to course_lib.grading.checks.expect_close" in noop
    assert "assigns to torch.testing.assert_close" in noop
    assert "course_lib.grading.checks.expect_close was replaced (before the check" in noop
    assert result(graded_class, "tamper_noop", "Exercise 0.3")[0] == "fail"
    assert "assigns to course_lib.grading.lab00.check_ring_shift" in rows["tamper_patch"]["flags"]
    assert "not implemented yet" in result(graded_class, "tamper_patch", "Exercise 0.3")[1]
    assert "writes a pass line ('✓ Exercise 0.2 passed')" in rows["tamper_print"]["flags"]
    assert "the check cell of Exercise 0.9 was edited" in rows["tamper_edit"]["flags"]
    status, message = result(graded_class, "tamper_during", "Exercise 0.9")
    assert status == "fail" and "while the check ran" in message
    assert "checks.expect_equal was replaced" in message


@pytest.mark.notebook
@SLOW_CLASS
def test_feedback_and_executed_notebooks_beside_the_gradebook_nothing_in_submissions(graded_class):
    out, subs = graded_class["out"], graded_class["subs"]
    assert tree(subs) == graded_class["before"]  # nothing written, nothing touched
    assert sorted(p.stem for p in (out / "feedback").glob("*.md")) == sorted(graded_class["rows"])
    page = (out / "feedback" / "wrong.md").read_text()
    assert "**Score: 0 of 3**" in page and "| Exercise 0.9 | failed |" in page
    assert "Noted by the grader" in (out / "feedback" / "tamper_noop.md").read_text()
    executed = nbformat.read(out / "executed" / "solved" / "00_mini.ipynb", as_version=4)
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)
    assert (out / "executed" / "flat" / "flat.ipynb").exists()
    assert (out / "outputs" / "solved" / "00_mini" / "written.txt").exists()


@pytest.mark.notebook
@SLOW_CLASS
def test_no_kernel_or_rank_is_left_running(graded_class):
    import os

    import psutil

    from course_lib.grading.runner import RUN_MARKER

    left = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if RUN_MARKER in env and env.get("COURSE_LIB_TEST_SESSION") == \
                os.environ["COURSE_LIB_TEST_SESSION"]:
            left.append(proc)
    assert not left, [p.cmdline() for p in left]


def test_the_gradebook_keeps_the_rows_written_before_a_stop(course, tmp_path, monkeypatch):
    """Rows are appended as students finish: a grader stopped half-way (here, by a
    KeyboardInterrupt while grading the second student) leaves a valid CSV of the first."""
    solutions, subs, _ = course
    real = grade.grade_file
    calls = []

    def stop_at_the_second(student, *args, **kwargs):
        calls.append(student)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(student, *args, **kwargs)

    monkeypatch.setattr(grade, "grade_file", stop_at_the_second)
    out = tmp_path / "gb.csv"
    with pytest.raises(KeyboardInterrupt):
        grade.gradebook(subs, solutions, out)
    rows = list(csv.DictReader(out.open()))
    assert [(r["student"], r["total"]) for r in rows] == [("alice", "2")]


def test_grading_refuses_to_write_into_the_submissions_folder(course):
    solutions, subs, _ = course
    with pytest.raises(ValueError, match="inside the submissions folder"):
        grade.gradebook(subs, solutions, subs / "gradebook.csv")
    assert grade.main([str(subs), "--solutions", str(solutions),
                       "--out", str(subs / "alice" / "gb.csv")]) == 2


def test_merge_combines_slices_and_refuses_a_student_twice(tmp_path):
    head = "student,Exercise 0.2,Exercise 0.10,total,status,flags\n"
    (tmp_path / "a.csv").write_text(head + "bo,1,0,1,ok,\n")
    (tmp_path / "a.details.csv").write_text(",".join(grade.DETAILS) + "\nbo,x.ipynb,00,Exercise 0.2,pass,ok,1.0\n")
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


@pytest.mark.slow  # Lab 00 runs twice more: `make test-slow` (CI runs it too)
@pytest.mark.notebook
def test_a_real_lab_solved_and_stub(tmp_path):
    """Lab 00 as students get it, graded against solutions/: the solution scores every
    exercise, the untouched lab none, and neither is flagged."""
    import shutil
    import time

    solutions, subs = tmp_path / "solutions", tmp_path / "submissions"
    solutions.mkdir()
    shutil.copy(ROOT / "solutions" / "00_launch.ipynb", solutions)
    (subs / "solved").mkdir(parents=True)
    shutil.copy(ROOT / "solutions" / "00_launch.ipynb", subs / "solved")
    shutil.copy(ROOT / "labs" / "00_launch.ipynb", subs / "stub.ipynb")
    started = time.monotonic()
    assert grade.main([str(subs), "--solutions", str(solutions),
                       "--out", str(tmp_path / "grades" / "gradebook.csv")]) == 0
    print(f"Lab 00: {(time.monotonic() - started) / 2:.0f} s per notebook")
    rows = {r["student"]: r for r in csv.DictReader((tmp_path / "grades" / "gradebook.csv").open())}
    assert (rows["solved"]["total"], rows["stub"]["total"]) == ("3", "0")
    assert rows["solved"]["flags"] == rows["stub"]["flags"] == ""
    assert rows["solved"]["status"] == rows["stub"]["status"] == "ok"
