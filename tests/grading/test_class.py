"""A whole class graded at once, as `make grade` would: honest work, every way a notebook
can go wrong, and students who tamper, each in another way. Nothing a submission does
changes its own grade unfairly, another's grade, or a file of the course."""
import csv
import hashlib
import os
from pathlib import Path

import psutil
import pytest
import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from conftest import SANDBOXES
from course_lib.grading import gradebook as grade
from course_lib.grading.labgen import exercises_in
from course_lib.grading.sandbox import RUN_MARKER, bwrap_works
from mini_lab import SHARD_BOUNDS, TOKEN_RING, edited, mini_solution, put, write_course

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT, CELL_TIMEOUT = 150, 25
# some of these students write into every file they can reach: never without the sandbox
pytestmark = [pytest.mark.slow, pytest.mark.notebook,
              pytest.mark.skipif(not bwrap_works(), reason="needs bwrap (Debian's bubblewrap)")]

WRONG_SHIFT = "def ring_shift(x):\n    return x.clone()  # no message at all"
TWO_RANKS_ONLY = '''def ring_shift(x):
    out = torch.empty_like(x)
    peer = 1 - dist.get_rank()  # right on 2 ranks, nowhere on 3
    comm.exchange(sends=[(x, peer)], recvs=[(out, peer)])
    return out'''
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
STUB_SHIFT = 'def ring_shift(x):\n    raise NotImplementedError("Exercise 0.3: ring shift")'
# ---- tamperings, each a way a student could try to pass without solving ---------------------
WRITES_EVERYWHERE = '''import pathlib
import course_lib
for root in {roots!r} + [str(pathlib.Path(course_lib.__file__).parent)]:
    for path in pathlib.Path(root).rglob("*"):
        try:
            if path.suffix in (".py", ".ipynb", ".csv", ".md"):
                with open(path, "a") as f:
                    f.write("\\ndef check_ring_shift(*a, **k):\\n    print('✓ Exercise 0.3 passed')\\n")
        except OSError:
            pass'''
DEFAULT_ARG = ("from course_lib.collectives import p2p\n\n"
               "def ring_shift(x, _impl=p2p.ring_shift):\n    return _impl(x)")
WRAPPER = ("from course_lib.collectives import p2p\n\nclass Shift:\n    def __call__(self, x):\n"
           "        return p2p.ring_shift(x)\n\nring_shift = Shift()")
READS_THE_SOLUTION = '''import json
nb = json.load(open({path!r}))
exec("".join(nb["cells"][7]["source"]))'''
EXCEPTION_HANDLER = '''def say_passed(shell, etype, value, tb, tb_offset=None):
    print("✓ Exercise 0.3 passed")
get_ipython().set_custom_exc((Exception,), say_passed)'''
PRINTS_ON_ACCESS = '''class Sneaky:
    def __getattr__(self, name):
        print("✓ Exercise 0.2 passed")
        raise KeyboardInterrupt
token_ring = Sneaky()'''
AGREEABLE_INT = '''class Same(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__

def shard_bounds(numel, rank, world):
    return Same(0), Same(0), Same(0)'''
AGREEABLE_TENSOR = '''class Same(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return True

def token_ring(token):
    return torch.zeros_like(token).as_subclass(Same)'''
REPLACES_THE_CHECKS = '''import sys, types
fake = types.SimpleNamespace(
    check_ring_shift=lambda *a, **k: print("✓ Exercise 0.3 passed"),
    check_token_ring=lambda *a, **k: print("✓ Exercise 0.2 passed"))
sys.modules.update({"course_lib.grading.lab00": fake})
lab00 = fake'''
PATCHES_COMPARISONS = '''import torch.testing
torch.testing.assert_close = lambda *a, **k: None
torch.equal = lambda *a, **k: True
torch.Tensor.__eq__ = lambda self, other: torch.ones_like(self, dtype=torch.bool)
checks.expect_close = lambda *a, **k: None
checks.expect_equal = lambda *a, **k: None'''
EXITS = "import os\nos._exit(0)"


def write_class(solution, lab, subs, solutions):
    """The submissions: {student: notebook}."""
    stub = edited(lab)
    notebooks = {
        "solved/00_mini.ipynb": solution, "flat.ipynb": solution, "stub.ipynb": lab,
        "wrong/mine.ipynb": edited(
            solution, token_ring=TOKEN_RING.replace("received + rank", "received + rank + 1"),
            ring_shift=WRONG_SHIFT, shard_bounds=SHARD_BOUNDS.replace("max(", "min(")),
        "hidden/00_mini.ipynb": edited(solution, ring_shift=TWO_RANKS_ONLY),
        "deadlock/00_mini.ipynb": edited(solution, ring_shift=DEADLOCKING_SHIFT,
                                         after={"setup": HANGING_RUN}),
        "stuck/00_mini.ipynb": edited(solution, after={"check02": IGNORES_INTERRUPT}),
        "crash/00_mini.ipynb": edited(solution, after={"check03": EXITS}),
        "tamper_write/00_mini.ipynb": edited(
            stub, after={"setup": WRITES_EVERYWHERE.format(roots=[str(ROOT), str(subs)])}),
        "tamper_default/00_mini.ipynb": edited(solution, ring_shift=DEFAULT_ARG),
        "tamper_wrapper/00_mini.ipynb": edited(solution, ring_shift=WRAPPER),
        "tamper_solution/00_mini.ipynb": edited(solution, ring_shift=READS_THE_SOLUTION.format(
            path=str(solutions / "00_mini.ipynb"))),
        "tamper_handler/00_mini.ipynb": edited(stub, after={"setup": EXCEPTION_HANDLER}),
        "tamper_access/00_mini.ipynb": edited(solution, token_ring=PRINTS_ON_ACCESS),
        "tamper_int/00_mini.ipynb": edited(solution, shard_bounds=AGREEABLE_INT),
        "tamper_tensor/00_mini.ipynb": edited(solution, token_ring=AGREEABLE_TENSOR),
        "tamper_modules/00_mini.ipynb": edited(stub, after={"setup": REPLACES_THE_CHECKS}),
        "tamper_compare/00_mini.ipynb": edited(solution, ring_shift=WRONG_SHIFT,
                                               after={"setup": PATCHES_COMPARISONS}),
        "tamper_print/00_mini.ipynb": edited(stub, after={"shard_bounds": (
            "print('✓ Exercise 0.2 passed')\nprint('✓ Exercise 3.3 passed')")}),
        "tamper_edit/00_mini.ipynb": edited(stub, check33="print('✓ Exercise 3.3 passed')"),
        "tamper_exit/00_mini.ipynb": edited(solution, shard_bounds=SHARD_BOUNDS + "\n" + EXITS),
    }
    for name, nb in notebooks.items():
        put(subs / name, nb)
    (subs / "broken").mkdir()
    (subs / "broken" / "00_mini.ipynb").write_text('{"cells": [ not json')
    put(subs / "other.ipynb", new_notebook(cells=[new_markdown_cell("### Exercise 5.1: x"),
                                                  new_code_cell("x = 1")]))


def tree(folder):
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*"))}


def digest(folder):
    found = hashlib.sha256()
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            found.update(str(path).encode() + path.read_bytes())
    return found.hexdigest()


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    """The class graded once, two notebooks at a time."""
    import time

    root = tmp_path_factory.mktemp("class")
    solutions, lab = write_course(root, hidden=True)
    subs, out = root / "submissions", root / "grades"
    write_class(mini_solution(hidden=True), lab, subs, solutions)
    before = {"subs": tree(subs), "course": digest(ROOT / "course_lib"),
              "solutions": digest(solutions)}
    started = time.monotonic()
    code = grade.main([str(subs), "--solutions", str(solutions), "--out",
                       str(out / "gradebook.csv"), "--timeout", str(TIMEOUT),
                       "--cell-timeout", str(CELL_TIMEOUT), "--jobs", "2"])
    seconds = time.monotonic() - started
    count = len(list(subs.iterdir()))
    print(f"graded {count} submissions in {seconds:.0f} s ({seconds / count:.1f} s each)")
    assert code == 0
    rows = {r["student"]: r for r in csv.DictReader((out / "gradebook.csv").open())}
    details = list(csv.DictReader((out / "gradebook.details.csv").open()))
    return {"rows": rows, "details": details, "out": out, "subs": subs, "before": before,
            "solutions": solutions}


def scores(row):
    return tuple(int(row[ex]) for ex in ("Exercise 0.2", "Exercise 0.3", "Exercise 3.3"))


def result(graded, student, exercise):
    (found,) = [(d["status"], d["message"]) for d in graded["details"]
                if d["student"] == student and d["exercise"] == exercise]
    return found


def test_every_student_gets_one_row_with_the_right_scores(graded_class):
    rows = graded_class["rows"]
    assert {s: scores(r) for s, r in rows.items()} == {
        "solved": (1, 1, 1), "flat": (1, 1, 1), "stub": (0, 0, 0), "wrong": (0, 0, 0),
        "hidden": (1, 0, 1), "deadlock": (1, 0, 1), "stuck": (1, 0, 0), "crash": (1, 1, 0),
        "broken": (0, 0, 0), "other": (0, 0, 0),
        "tamper_write": (0, 0, 0), "tamper_default": (1, 0, 1), "tamper_wrapper": (1, 0, 1),
        "tamper_solution": (1, 0, 1), "tamper_handler": (0, 0, 0), "tamper_access": (0, 1, 1),
        "tamper_int": (1, 1, 0), "tamper_tensor": (0, 1, 1), "tamper_modules": (0, 0, 0),
        "tamper_compare": (1, 0, 1), "tamper_print": (0, 0, 0), "tamper_edit": (0, 0, 0),
        "tamper_exit": (1, 1, 0)}
    assert all(int(r["total"]) == sum(scores(r)) for r in rows.values())
    assert rows["solved"]["status"] == "ok" and rows["solved"]["flags"] == ""


def test_nothing_a_submission_does_changes_the_course_or_another_submission(graded_class):
    before = graded_class["before"]
    assert tree(graded_class["subs"]) == before["subs"]
    assert digest(ROOT / "course_lib") == before["course"]
    assert digest(graded_class["solutions"]) == before["solutions"]
    # the student who wrote everywhere ran before and after others: their stubs still fail
    assert result(graded_class, "tamper_write", "Exercise 0.3") == result(
        graded_class, "stub", "Exercise 0.3")


def test_wrong_answers_fail_their_checks_hidden_tests_included(graded_class):
    assert result(graded_class, "wrong", "Exercise 0.2")[0] == "fail"
    status, message = result(graded_class, "wrong", "Exercise 0.3")
    assert status == "fail" and message.startswith("Exercise 0.3: rank 0 of world size 2")
    assert result(graded_class, "wrong", "Exercise 3.3")[0] == "fail"
    # passes the visible case on 2 ranks; the lab's hidden test on 3 ranks, or the settings
    # the gradebook draws for this student (another world size, masked in the message),
    # catches it
    status, message = result(graded_class, "hidden", "Exercise 0.3")
    assert status == "fail" and ("world size 3" in message
                                 or "drew for this submission (not shown)" in message), message
    status, message = result(graded_class, "stub", "Exercise 0.3")
    assert status == "fail" and "not implemented yet" in message


def test_hangs_crashes_and_bad_files_get_a_row_that_says_so(graded_class):
    rows = graded_class["rows"]
    status, message = result(graded_class, "deadlock", "Exercise 0.3")
    assert status == "fail" and "did not finish in 10s" in message
    # the student's own job that hangs in a cell is interrupted; the notebook goes on
    assert f"ok (cell 5 stopped after {CELL_TIMEOUT} s" in rows["deadlock"]["status"]
    assert "timeout" in rows["stuck"]["status"]
    assert result(graded_class, "stuck", "Exercise 3.3")[0] == "timeout"
    assert "crashed" in rows["crash"]["status"]
    assert result(graded_class, "crash", "Exercise 3.3")[0] == "error"
    assert "invalid notebook" in rows["broken"]["status"]
    assert "wrong lab" in rows["other"]["status"] and "matches no lab" in rows["other"]["status"]


def test_each_tampering_is_refused_and_flagged(graded_class):
    rows = graded_class["rows"]
    for student in ("tamper_default", "tamper_wrapper"):
        status, message = result(graded_class, student, "Exercise 0.3")
        assert status == "fail" and "course_lib's own implementation" in message
        assert "course_lib.collectives.p2p.ring_shift" in message
    assert "No such file" in result(graded_class, "tamper_solution", "Exercise 0.3")[1] or \
        "does not define 'ring_shift'" in result(graded_class, "tamper_solution", "Exercise 0.3")[1]
    assert "builds code or names at run time (exec)" in rows["tamper_solution"]["flags"]
    assert "cannot take" in result(graded_class, "tamper_int", "Exercise 3.3")[1]
    assert "subclass of torch.Tensor" in result(graded_class, "tamper_tensor", "Exercise 0.2")[1]
    assert "assigns to torch.testing.assert_close" in rows["tamper_compare"]["flags"]
    assert "writes a pass line ('✓ Exercise 0.2 passed')" in rows["tamper_print"]["flags"]
    assert "the check cell of Exercise 3.3 was edited" in rows["tamper_edit"]["flags"]
    assert "crashed" in rows["tamper_exit"]["status"]
    assert not any("unsandboxed" in r["flags"] for r in rows.values())


def test_feedback_and_executed_notebooks_beside_the_gradebook(graded_class):
    out = graded_class["out"]
    assert sorted(p.stem for p in (out / "feedback").glob("*.md")) == sorted(graded_class["rows"])
    page = (out / "feedback" / "wrong.md").read_text()
    assert "**Score: 0 of 3**" in page and "| Exercise 3.3 | failed |" in page
    assert (out / "executed" / "flat" / "flat.ipynb").exists()
    assert (out / "outputs" / "solved" / "00_mini" / "written.txt").exists()


def test_no_process_of_any_submission_is_left_running(graded_class):
    left = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if RUN_MARKER in env and env.get("COURSE_LIB_TEST_SESSION") == \
                os.environ["COURSE_LIB_TEST_SESSION"] and env[RUN_MARKER] not in SANDBOXES:
            left.append(proc)  # (the session's shared sandbox, which earlier tests use, stays)
    assert not left, [p.cmdline() for p in left]


def test_a_real_lab_solved_and_untouched(tmp_path):
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
    items = exercises_in(nbformat.read(ROOT / "solutions" / "00_launch.ipynb", as_version=4))
    assert len(items) >= 5  # three exercises and two predictions
    assert (rows["solved"]["total"], rows["stub"]["total"]) == (str(len(items)), "0")
    assert rows["solved"]["flags"] == rows["stub"]["flags"] == ""
    assert rows["solved"]["status"] == rows["stub"]["status"] == "ok"
