"""The doors through which an informed student (one who has read course_lib/grading/,
which every student has in their own copy) could be credited without the work, each
closed by construction and shown closed through the gradebook with tamperings that
passed before:

1. The harness ran in the student's process, found by name: a job replaced by name
   there was the one shipped to the ranks. Now the judge sends each harness by value,
   and the collector holds what runs a request from before the first student cell.
2. The answers were reachable: course_lib/grading/ (inputs, formulas, references) could
   be imported and read in the sandbox. Now the sandbox mounts a stand-in there.
3. The reference walk decided by names: a clone of the library's code, or a copy made
   some other way, went past it. Now, while a lab is graded, the sandbox's copy of each
   module holding one of its answers has a stand-in in its place (grading/hiding.py):
   there is no code of the answer to clone, copy or call.
4. The instruments a check reads (comm's counters, a FLOP counter, wrappers that log
   posts and waits) lived in the rank beside the student's code, which could write
   them. Now the traffic graded is counted on the process group's own methods, in the
   judge's job, and a counter written to or a wrapper taken out breaks the seal: the
   check fails and the notebook is flagged.
5. The settings were fixed and visible: a table of the check's cases (or of the input
   pattern its messages print) passed. Now every check also runs on settings the judge
   draws for each student from the class's secret, never shown.
6. What runs could differ from the notebook's text. Now such code is flagged by cell
   (and the judge, reading the text, sees the stub the text still holds).

Each tampering below writes what a student who read the grader would write; before
this construction each was credited (1 and 2a silently, 2b with a flag for eval).
"""
import csv
import random

import pytest

from course_lib.grading import gradebook as grade
from course_lib.grading.sandbox import bwrap_works
from mini_lab import SHARD_BOUNDS, edited, mini_solution, put, write_course

pytestmark = [pytest.mark.slow, pytest.mark.notebook,
              pytest.mark.skipif(not bwrap_works(),
                                 reason="needs bwrap (Debian's bubblewrap)")]

STUB_SHIFT = 'def ring_shift(x):\n    raise NotImplementedError("Exercise 0.3: ring shift")'
# door 1a: the check's rank job, replaced by name with one that forges the report
# (the input pattern and the counts it checks are in course_lib/grading/lab00)
REPLACES_THE_JOB = '''import course_lib.grading.lab00 as grader

def forged(ring_shift, numel):
    rank, world = dist.get_rank(), dist.get_world_size()
    left = torch.full((numel,), float((rank - 1) % world)) + torch.arange(numel) * 1e-3
    return left, {"sent_messages": 1, "recv_messages": 1}

grader.shift_job = forged'''
# door 1b: what runs a request on the student's side, replaced by name with a forger
REPLACES_THE_RUNNER = '''import sys
import course_lib.submission.calls as calls
from course_lib.submission import plain

def forged_execute(request, keep=None):
    if request.kind != "ranks":
        return {"ok": plain.encode({})}
    numel, world = request.args[1], request.nproc
    out = [(torch.full((numel,), float((r - 1) % world)) + torch.arange(numel) * 1e-3,
            {"sent_messages": 1, "recv_messages": 1}) for r in range(world)]
    return {"ok": plain.encode(out)}

calls.execute = forged_execute
sys.modules["__main__"].execute = forged_execute'''
# door 2a: the check's own input pattern, imported on the ranks (one token message each
# way keeps the counts right)
IMPORTS_THE_INPUTS = '''def ring_shift(x):
    from course_lib.grading.lab00 import _shift_input
    rank, world = dist.get_rank(), dist.get_world_size()
    comm.exchange(sends=[(x[:1].clone(), (rank + 1) % world)],
                  recvs=[(torch.empty(1), (rank - 1) % world)])
    return _shift_input((rank - 1) % world, x.numel())'''
# door 2b: the check's formula, read from its source file
READS_THE_FORMULA = '''import pathlib, re
import course_lib
_check = (pathlib.Path(course_lib.__file__).parent / "grading" / "lab03.py").read_text()
_padded = re.search(r"padded = (.+)", _check.split("def check_shard_bounds")[1]).group(1)

def shard_bounds(numel, rank, world):
    padded = eval(_padded)
    size = padded // world
    return rank * size, (rank + 1) * size, padded'''


# door 6a: an input transformer rewrites the stub as it runs; the text keeps the stub
REWRITES_THE_CELLS = '''def _solve(lines):
    return [line.replace('raise NotImplementedError("Exercise 0.3: ring shift")',
                         "out = torch.empty_like(x); comm.exchange(sends=[(x, (rank + 1) % world)], "
                         "recvs=[(out, (rank - 1) % world)]); return out") for line in lines]
get_ipython().input_transformers_post.append(_solve)'''
# door 6b: the stub's code object swapped for a working one defined under another name
SWAPS_THE_CODE = '''def _shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.empty_like(x)
    comm.exchange(sends=[(x, (rank + 1) % world)], recvs=[(out, (rank - 1) % world)])
    return out

def ring_shift(x):
    raise NotImplementedError("Exercise 0.3: ring shift")

ring_shift.__code__ = _shift.__code__'''


# door 3a: the library's ring shift rebuilt from its code object (no name to catch)
CLONES_THE_CODE = '''import types
from course_lib.collectives import p2p
ring_shift = types.FunctionType(p2p.ring_shift.__code__, vars(p2p), "mine")'''
# door 3b: the library's function, copied through pickle under another name
COPIES_BY_PICKLE = '''import pickle
import course_lib.collectives.p2p as helpers
_copy = pickle.loads(pickle.dumps(helpers.ring_shift))

def ring_shift(x):
    return _copy(x)'''


# door 5a: the answers of exactly the check's cases (its seed is in the grader's source,
# the answers in its failure messages), copied into the notebook as a table
def _visible_bounds():
    rng = random.Random(2)  # check_shard_bounds's seed, read from the grader
    cases = [(10, 3), (9, 3), (1, 4), (0, 2), (7, 1)]
    cases += [(rng.randint(0, 1000), rng.randint(1, 9)) for _ in range(300)]
    table = {}
    for numel, world in cases:
        size = max(-(-numel // world), 1)
        for rank in range(world):
            table[(numel, rank, world)] = (rank * size, (rank + 1) * size, size * world)
    return table


TABLES_THE_CASES = f"""_ANSWERS = {_visible_bounds()!r}

def shard_bounds(numel, rank, world):
    return _ANSWERS.get((numel, rank, world), (0, numel, numel))"""
# door 5b: the neighbour's tensor rebuilt from the input pattern the messages print
# (rank r holds r + j/1000), with one token message each way for the counts
FOLLOWS_THE_PATTERN = '''def ring_shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    comm.exchange(sends=[(x[:1].clone(), (rank + 1) % world)],
                  recvs=[(torch.empty(1), (rank - 1) % world)])
    return torch.full((x.numel(),), float((rank - 1) % world)) + torch.arange(x.numel()) * 1e-3'''


# door 4a: the right tensor from the pattern, and comm's counters written as if one
# message went each way (none did)
FORGES_THE_COUNTS = '''def ring_shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    for stats in comm._active:
        stats.add_send(4, (rank + 1) % world)
        stats.add_recv(4, (rank - 1) % world)
    return torch.full((x.numel(),), float((rank - 1) % world)) + torch.arange(x.numel()) * 1e-3'''
# door 4b: the shift in two halves (two messages each way, one too many), with the
# wire's counters taken off the process group while the second half goes
HIDES_A_MESSAGE = '''def ring_shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.empty_like(x)
    half = x.numel() // 2
    comm.exchange(sends=[(x[:half], (rank + 1) % world)], recvs=[(out[:half], (rank - 1) % world)])
    group_class = type(dist.group.WORLD)
    sealed = {name: group_class.__dict__[name] for name in ("send", "recv")}
    for name, wrapper in sealed.items():
        setattr(group_class, name, wrapper.__closure__[1].cell_contents)
    rest = out[half:].clone()
    works = [dist.irecv(rest, (rank - 1) % world), dist.isend(x[half:].clone(), (rank + 1) % world)]
    for work in works:
        work.wait()
    out[half:] = rest
    return out'''


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("doors")
    solutions, lab = write_course(root)
    solution = mini_solution()
    subs = root / "submissions"
    notebooks = {
        "solved": solution,
        "door1_job": edited(solution, ring_shift=STUB_SHIFT, after={"setup": REPLACES_THE_JOB}),
        "door1_runner": edited(solution, ring_shift=STUB_SHIFT,
                               after={"setup": REPLACES_THE_RUNNER}),
        "door2_inputs": edited(solution, ring_shift=IMPORTS_THE_INPUTS),
        "door2_formula": edited(solution, shard_bounds=READS_THE_FORMULA),
        "door3_clone": edited(solution, ring_shift=CLONES_THE_CODE),
        "door3_pickle": edited(solution, ring_shift=COPIES_BY_PICKLE),
        "door6_transformer": edited(solution, ring_shift=STUB_SHIFT,
                                    after={"setup": REWRITES_THE_CELLS}),
        "door6_code": edited(solution, ring_shift=SWAPS_THE_CODE),
        "door4_counts": edited(solution, ring_shift=FORGES_THE_COUNTS),
        "door4_unsealed": edited(solution, ring_shift=HIDES_A_MESSAGE),
        "door5_table": edited(solution, shard_bounds=TABLES_THE_CASES),
        "door5_pattern": edited(solution, ring_shift=FOLLOWS_THE_PATTERN),
    }
    for student, nb in notebooks.items():
        put(subs / student / "00_mini.ipynb", nb)
    out = root / "grades" / "gradebook.csv"
    assert grade.main([str(subs), "--solutions", str(solutions), "--out", str(out),
                       "--timeout", "150", "--cell-timeout", "25", "--jobs", "2"]) == 0
    rows = {r["student"]: r for r in csv.DictReader(out.open())}
    details = {(d["student"], d["exercise"]): d
               for d in csv.DictReader(out.with_name("gradebook.details.csv").open())}
    return rows, details


def scores(row):
    return tuple(int(row[ex]) for ex in ("Exercise 0.2", "Exercise 0.3", "Exercise 3.3"))


def test_the_solution_keeps_full_marks(graded):
    rows, _ = graded
    assert scores(rows["solved"]) == (1, 1, 1) and rows["solved"]["flags"] == ""


def test_door_1_a_job_or_the_runner_replaced_by_name_is_not_what_runs(graded):
    rows, details = graded
    for student in ("door1_job", "door1_runner"):
        assert scores(rows[student]) == (1, 0, 1), (student, rows[student])
        assert "not implemented" in details[(student, "Exercise 0.3")]["message"]


def test_door_2_the_graders_inputs_and_formulas_are_not_in_the_sandbox(graded):
    rows, details = graded
    assert scores(rows["door2_inputs"]) == (1, 0, 1), rows["door2_inputs"]
    assert "course_lib.grading.lab00" in details[("door2_inputs", "Exercise 0.3")]["message"]
    assert scores(rows["door2_formula"]) == (1, 1, 0), rows["door2_formula"]
    assert "does not define 'shard_bounds'" in details[("door2_formula", "Exercise 3.3")]["message"]


def test_door_6_what_runs_is_what_the_text_says_or_a_flag(graded):
    rows, _ = graded
    assert scores(rows["door6_transformer"]) == (1, 0, 1), rows["door6_transformer"]
    assert "hooks IPython (input_transformers_post)" in rows["door6_transformer"]["flags"]
    # the working code is in the text, under another name: credited or not, a person
    # reads the notebook (the flag says why)
    assert scores(rows["door6_code"])[0::2] == (1, 1), rows["door6_code"]
    assert "swaps __code__" in rows["door6_code"]["flags"], rows["door6_code"]


def test_door_3_the_librarys_answer_is_not_in_the_sandbox_to_copy(graded):
    rows, details = graded
    for student in ("door3_clone", "door3_pickle"):
        assert scores(rows[student]) == (1, 0, 1), (student, rows[student])
        message = details[(student, "Exercise 0.3")]["message"]
        # refused by the source reader, stopped by the stand-in, or (the clone: the
        # stand-in's code cannot even be rebuilt as the library's) never defined
        assert any(why in message for why in (
            "library's answer to Exercise 0.3", "course_lib's own implementation",
            "does not define 'ring_shift'")), message


def test_door_5_a_table_of_the_visible_settings_fails_the_drawn_ones(graded):
    rows, details = graded
    assert scores(rows["door5_table"]) == (1, 1, 0), rows["door5_table"]
    assert scores(rows["door5_pattern"]) == (1, 0, 1), rows["door5_pattern"]
    for student, exercise in (("door5_table", "Exercise 3.3"), ("door5_pattern", "Exercise 0.3")):
        message = details[(student, exercise)]["message"]
        assert "settings the grader drew for this submission (not shown)" in message, message


def test_door_4_a_counter_written_or_taken_out_fails_and_is_flagged(graded):
    rows, details = graded
    for student, why in (("door4_counts", "counted traffic that never went out"),
                         ("door4_unsealed", "ProcessGroup.send was replaced")):
        assert scores(rows[student]) == (1, 0, 1), (student, rows[student])
        message = details[(student, "Exercise 0.3")]["message"]
        assert "instruments the check reads were written to or taken out" in message, message
        assert why in message, message
        assert "Exercise 0.3: " in rows[student]["flags"], rows[student]["flags"]
    assert "reaches beneath the instruments (course_lib.comm._active)" in \
        rows["door4_counts"]["flags"]
