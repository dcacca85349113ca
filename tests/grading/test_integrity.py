"""Reference detection (live objects, in the kernel and the sandbox) and the static scan of a
submission's cells for the flags."""
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib import comm
from course_lib.collectives import p2p
from course_lib.grading import checks, integrity, references
from course_lib.grading.labgen import exercises_in

ship_by_value(__name__)
ROOT = Path(__file__).resolve().parents[2]


def my_ring_shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.empty_like(x)
    comm.exchange(sends=[(x, (rank + 1) % world)], recvs=[(out, (rank - 1) % world)])
    return out


def calls_the_reference(x):
    return p2p.ring_shift(x)


def through_a_helper(x):
    return calls_the_reference(x)


def imports_it_inside(x):
    from course_lib.collectives.p2p import ring_shift as theirs
    return theirs(x)


def test_every_registered_reference_resolves():
    for exercise, entries in references.REFERENCES.items():
        for entry in entries:
            assert references.resolve(entry) is not None, (exercise, entry)


@pytest.mark.parametrize("fn,found", [
    (p2p.ring_shift, "ring_shift is course_lib.collectives.p2p.ring_shift"),
    (calls_the_reference, "calls_the_reference uses course_lib.collectives.p2p.ring_shift"),
    (through_a_helper, "through_a_helper -> calls_the_reference uses course_lib.collectives"),
    (imports_it_inside, "imports_it_inside uses course_lib.collectives.p2p.ring_shift"),
])
def test_reference_use_is_found_directly_through_helpers_and_imports(fn, found):
    (line,) = references.reference_use("Exercise 0.3", [fn])
    assert line.startswith(found)


def test_own_code_and_other_exercises_references_are_not_reported():
    assert references.reference_use("Exercise 0.3", [my_ring_shift]) == []
    # token_ring's reference is another exercise's business
    assert references.reference_use("Exercise 0.2", [calls_the_reference]) == []
    assert references.reference_use("Exercise 9.9", [p2p.ring_shift]) == []


def test_a_class_deriving_from_the_reference_is_reported():
    from course_lib.ddp import DDP

    class MyDDP(DDP):
        pass

    assert references.reference_use("Exercise 2.3", [MyDDP]) == [
        "test_a_class_deriving_from_the_reference_is_reported.<locals>.MyDDP derives from "
        "course_lib.ddp.bucketed.DDP"]


def test_autograd_functions_own_and_the_reference():
    """An autograd Function and its backward class name each other: no endless walk."""
    from course_lib.fsdp.unit import GatherShards

    class MyGather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, shard, group):
            return shard.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class Copied(torch.autograd.Function):
        forward = staticmethod(GatherShards.forward)
        backward = staticmethod(GatherShards.backward)

    assert references.reference_use("Exercise 3.6", [MyGather]) == []
    assert references.reference_use("Exercise 3.6", [GatherShards]) == [
        "GatherShards is course_lib.fsdp.unit.GatherShards"]
    assert references.reference_use("Exercise 3.6", {"Copied": Copied}) == [
        "Copied.forward has the code of course_lib.fsdp.unit.GatherShards",
        "Copied.backward has the code of course_lib.fsdp.unit.GatherShards"]


def test_a_check_refuses_the_reference_before_starting_a_job():
    from course_lib.grading import lab00

    checks.guard_references(True)
    try:
        with pytest.raises(checks.CheckFailed, match="course_lib's own implementation") as info:
            checks.launch("Exercise 0.3", calls_the_reference, torch.ones(3), nproc=2)
        assert "calls_the_reference uses course_lib.collectives.p2p.ring_shift" in str(info.value)
        assert checks.outcome("Exercise 0.3") == "failed"
        with pytest.raises(checks.CheckFailed, match="own implementation"):
            lab00.check_ring_shift(through_a_helper)
        # the student's own code goes through, on real ranks
        out = checks.launch("Exercise 0.3", my_ring_shift, torch.arange(4.0), nproc=2)
        assert [t.tolist() for t in out] == [[0, 1, 2, 3]] * 2
    finally:
        checks.guard_references(None)


def test_outside_a_kernel_the_guard_is_off_unless_asked_for(monkeypatch, capsys):
    from course_lib.grading import lab03_fsdp

    prefetch = references.resolve("course_lib.fsdp.fsdp:prefetch_targets")
    monkeypatch.delenv("COURSE_LIB_REFERENCE_GUARD", raising=False)
    lab03_fsdp.check_prefetch_plan(prefetch, trials=5)  # the library's tests hand the references
    assert "✓ Exercise 3.8 passed" in capsys.readouterr().out  # to the checks as known-good
    monkeypatch.setenv("COURSE_LIB_REFERENCE_GUARD", "1")
    with pytest.raises(checks.CheckFailed, match="own implementation"):
        lab03_fsdp.check_prefetch_plan(prefetch, trials=5)


def test_the_judge_refuses_the_reference_whatever_the_kernel_s_setting(sandbox):
    from course_lib.grading import lab00

    with pytest.raises(checks.CheckFailed, match="through_a_helper -> calls_the_reference uses"):
        judged(sandbox, lab00.check_ring_shift, through_a_helper)


# ---- the static scan ---------------------------------------------------------------------------
LAB00 = nbformat.read(ROOT / "labs" / "00_launch.ipynb", as_version=4)
LAB_SOURCES = [c.source for c in LAB00.cells if c.cell_type == "code"]
EXERCISES = [ex for ex, _ in exercises_in(LAB00)]


def scan(*cells):
    return integrity.scan([(f"cell {i}", src) for i, src in enumerate(cells)], LAB_SOURCES,
                          EXERCISES)


def test_the_lab_itself_is_never_flagged():
    assert scan(*LAB_SOURCES) == []
    # its setup cell, edited: only the new import is the student's
    setup = next(s for s in LAB_SOURCES if "from course_lib.collectives.p2p import" in s)
    assert scan(setup + "\nimport numpy\nfrom course_lib.collectives.p2p import ring_shift") == [
        "cell 0: imports ring_shift from course_lib.collectives.p2p (course_lib's implementation "
        "of Exercise 0.3)"]


@pytest.mark.parametrize("source,flag", [
    ("import course_lib.collectives.p2p as p", "imports course_lib.collectives.p2p (a module holding"),
    ("from course_lib.collectives import p2p", "imports p2p from course_lib.collectives"),
    ("from course_lib.grading import judge", "imports judge from course_lib.grading (the grader's"),
    ("exec(open('x.py').read())", "builds code or names at run time (exec)"),
    ("getattr(p2p, 'ring' + '_shift')", "builds code or names at run time (getattr)"),
    ("checks.expect_close = lambda *a, **k: None", "assigns to course_lib.grading.checks.expect_close"),
    ("lab00.check_ring_shift = print", "assigns to course_lib.grading.lab00.check_ring_shift"),
    ("torch.testing.assert_close = None", "assigns to torch.testing.assert_close"),
    ("import torch.testing as tt\ntt.assert_close = None", "assigns to torch.testing.assert_close"),
    ("del checks.expect_equal", "deletes course_lib.grading.checks.expect_equal"),
    ("setattr(lab00, 'check_ping_pong', print)", "calls setattr on course_lib.grading.lab00"),
    ("vars(checks)['passed'] = print", "assigns to course_lib.grading.checks"),
    ("import sys\nsys.stdout = open('x', 'w')", "assigns to sys.stdout"),
    ("def ping_pong(p, i):\n    comm.counting = None", "assigns to course_lib.comm.counting"),
    ("%%torchrun -n 2\nimport course_lib.comm as c\nc.send = print", "assigns to course_lib.comm.send"),
    ("print('✓ Exercise 0.2 passed')", "writes a pass line ('✓ Exercise 0.2 passed')"),
    ("print('✓ Prediction 1.1 passed')", "writes a pass line ('✓ Prediction 1.1 passed')"),
    ("checks.passed('Exercise 0.1')", "calls checks.passed itself"),
])
def test_tampering_is_flagged(source, flag):
    found = scan(source)
    assert any(line.startswith(f"cell 0: {flag}") for line in found), found


@pytest.mark.parametrize("source,flag", [
    ("import sys\nf = sys._getframe(1)", "inspects frames (sys._getframe)"),
    ("import inspect\nouter = inspect.stack()[2].frame.f_locals", "inspects frames (inspect.stack)"),
    ("import gc\nfound = [o for o in gc.get_objects() if callable(o)]", "walks gc (gc.get_objects)"),
    ("import sys\nsys.setprofile(lambda *a: None)", "hooks the profiler (sys.setprofile)"),
    ("import threading\nthreading.settrace(print)", "hooks the tracer (threading.settrace)"),
    ("get_ipython().input_transformers_post.append(str.upper)", "hooks IPython (input_transformers_post)"),
    ("get_ipython().set_custom_exc((Exception,), print)", "hooks IPython (set_custom_exc)"),
    ("def f(x):\n    return x\nf.__code__ = (lambda x: 0).__code__", "swaps __code__"),
    ("obj.__class__ = int", "swaps __class__"),
    ("class T:\n    def __reduce__(self):\n        return (print, ())", "defines __reduce__"),
    ("import subprocess\nsubprocess.run(['python3', '-c', '1'])", "starts a process (subprocess.run)"),
    ("import os\nos.system('python3 x.py')", "starts a process (os.system)"),
    ("import course_lib\nopen(course_lib.__file__).read()", "reads a course file's path (course_lib.__file__)"),
    ("import inspect\nfrom course_lib import comm\ninspect.getsource(comm)", "reads source code (inspect.getsource)"),
    # what the judge ships (a harness, the library's pieces it is built on) runs beside the
    # student's code on the ranks: its insides, or code carried to a later request
    ("def take(model):\n    return type(model).forward.__globals__['Bucket']",
     "reads a function's insides (__globals__)"),
    ("keep = object.__subclasses__()", "reads a function's insides (__subclasses__)"),
    ("def take(step):\n    return step.__defaults__[0]", "reads a function's insides (__defaults__)"),
    ("import inspect\ndef take(unit):\n    return inspect.signature(type(unit)).parameters",
     "reads a function's insides (inspect.signature)"),
    # a class sent by value, written to a file on a rank and read back in another process
    ("from course_lib.runtime import pickling\nblob = pickling.dumps(type(model))",
     "turns code into bytes (course_lib.runtime.pickling.dumps)"),
    ("import torch\nkept = torch.load('/tmp/kept.pt', weights_only=False)",
     "rebuilds objects from bytes (torch.load, weights_only=False)"),
    ("import sys\ntry:\n    1 / 0\nexcept ZeroDivisionError as e:\n    up = e.__traceback__.tb_frame.f_back",
     "inspects frames (f_back)"),
    # a warm rank outlives the request: kept on a module, it reaches a later item's
    ("def train_step(model):\n    import collections\n    collections.kept = type(model)",
     "keeps something on a module (collections.kept)"),
    ("import marshal\nblob = marshal.dumps(fn.__code__)", "turns code into bytes (marshal.dumps)"),
    ("import types\nf = types.FunctionType(code, globals())",
     "builds a function from a code object (types.FunctionType)"),
    ("import pickle\nf = pickle.load(open('/tmp/kept.pkl', 'rb'))",
     "rebuilds objects from bytes (pickle.load)"),
])
def test_code_behind_the_text_is_flagged(source, flag):
    """Door 6: what makes what runs differ from what the notebook says, or reads what the
    grader keeps, is flagged with the cell's label (a person reads such notebooks)."""
    found = scan(source)
    assert any(line.startswith(f"cell 0: {flag}") for line in found), found


@pytest.mark.parametrize("source,flag", [
    ("from course_lib import comm\ncomm._active[-1].sent_bytes = 0",
     "reaches beneath the instruments (course_lib.comm._active)"),
    ("import torch\nstack = torch._C._len_torch_dispatch_stack()",
     "reaches beneath the instruments (torch._C)"),
    ("from torch.utils import _python_dispatch as d\nm = d._pop_mode()",
     "reaches beneath the instruments (torch.utils._python_dispatch)"),
    ("import torch.distributed as dist\nb = dist.group.WORLD._get_backend(None)",
     "reaches beneath the instruments (torch.distributed.group.WORLD._get_backend)"),
    ("import threading\nthreading.Thread(target=print).start()",
     "runs code in another thread (threading.Thread)"),
    ("import importlib\nddp = importlib.import_module('course_lib.ddp.bucketed').DDP",
     "imports a module named by a string (importlib.import_module)"),
    ("import sys\nring = sys.modules['course_lib.collectives.ring']",
     "reaches a module through sys.modules"),
])
def test_code_beneath_the_instruments_is_flagged(source, flag):
    """Door 4: what reaches the counters a check reads from the student's side."""
    found = scan(source)
    assert any(line.startswith(f"cell 0: {flag}") for line in found), found


def test_harmless_code_is_not_flagged():
    assert scan("x = torch.zeros(3)\nx.add_(1)\nmodel.weight = None\nimport numpy as np",
                "def f():\n    return dist.get_rank()", "%timeit f()", "os.environ['A'] = '1'",
                "class B:\n    def __init__(self):\n        self._buckets = []\n"
                "    def add(self, x):\n        self._buckets.append(x)") == []


def test_a_call_an_exercise_asks_for_is_not_flagged_in_its_lab():
    """Exercise 8.6 asks for a thread: Lab 08's scan lets it pass, another lab's flags it."""
    source = "import threading\nthreading.Thread(target=print, daemon=True).start()"
    cells = [("cell 0", source)]
    assert integrity.scan(cells, [], ["Exercise 8.5", "Exercise 8.6"]) == []
    assert integrity.scan(cells, [], ["Exercise 2.3"]) == [
        "cell 0: runs code in another thread (threading.Thread)"]
