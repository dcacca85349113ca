"""Check helpers: messages a student can act on; stubs and hangs translated."""
import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import run
from course_lib.grading import checks
from course_lib.runtime import launcher
from course_lib.runtime.launcher import LaunchError, LaunchTimeout

ship_by_value(__name__)


@pytest.fixture(autouse=True)
def fresh_outcomes():
    """Every test starts from a kernel in which no exercise was checked."""
    checks._outcomes.clear()
    yield
    checks._outcomes.clear()


def test_expect_close_names_rank_tensor_and_first_difference():
    checks.expect_close("Exercise 9.9", torch.ones(3), torch.ones(3), rank=0, world_size=2)
    with pytest.raises(checks.CheckFailed) as info:
        checks.expect_close("Exercise 9.9", torch.tensor([1.0, 5.0, 3.0]),
                            torch.tensor([1.0, 2.0, 3.0]), rank=2, world_size=3,
                            what="the sum", hint="add, don't multiply")
    msg = str(info.value)
    assert msg.startswith("Exercise 9.9: rank 2 of world size 3, the sum: wrong values")
    assert "flat index 1: expected 2.0, got 5.0" in msg and "Hint: add, don't multiply" in msg


@pytest.mark.parametrize("got,fragment", [
    (torch.ones(4), "expected shape (3,), got (4,)"),
    (torch.ones(3, dtype=torch.int64), "expected dtype torch.float32, got torch.int64"),
    ([1.0, 1.0, 1.0], "expected a tensor, got list"),
])
def test_expect_close_catches_shape_dtype_and_type(got, fragment):
    with pytest.raises(checks.CheckFailed, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        checks.expect_close("Exercise 9.9", got, torch.ones(3), rank=0, world_size=1)


def test_expect_equal_and_passed(capsys):
    checks.expect_equal("Exercise 9.9", {1: 4}, {1: 4}, rank=0, world_size=2)
    with pytest.raises(checks.CheckFailed, match=r"expected \{1: 4\}, got \{1: 8\}"):
        checks.expect_equal("Exercise 9.9", {1: 8}, {1: 4}, rank=0, world_size=2, what="bytes")
    checks.passed("Exercise 9.9", "all good")
    assert capsys.readouterr().out == "✓ Exercise 9.9 passed (all good)\n"


def stub():
    raise NotImplementedError("Exercise 9.9: something")


def hang():
    dist.recv(torch.zeros(1), (dist.get_rank() + 1) % dist.get_world_size())


def crash():
    return 1 / 0 if dist.get_rank() == 1 else 0


def test_launch_translates_stub_and_crash():
    with pytest.raises(NotImplementedError, match="Exercise 9.9 is not implemented yet"):
        checks.launch("Exercise 9.9", stub, nproc=2)
    assert checks.outcome("Exercise 9.9") == "failed"
    with pytest.raises(checks.CheckFailed, match="raised on rank 1 .world size 2.") as info:
        checks.launch("Exercise 9.9", crash, nproc=2)
    assert "ZeroDivisionError" in str(info.value)


@pytest.mark.slow  # waits out a timeout: `make test-slow`
def test_launch_translates_a_hang():
    # a job of its own: a job reused from earlier tests of this module has (once in a full
    # suite, never alone) reported its ranks as exited instead of dumping their stacks
    with pytest.raises(checks.CheckFailed, match="did not finish in 15s") as info:
        checks.launch("Exercise 9.9", hang, nproc=2, timeout=15, fresh=True)
    msg = str(info.value)
    assert "Hint: ranks 0 and 1 both wait in recv() and no rank is sending. Look for a send " \
           "or recv that no other rank matches" in msg
    assert ", in hang" in msg and "runtime/worker.py" not in msg
    assert info.value.diagnosis.kind == "p2p"
    assert "runtime/worker.py" in info.value.stacks[0]  # untrimmed, for instructors


def mismatched_collectives():
    x = torch.ones(1000)
    if dist.get_rank() == 0:
        dist.all_reduce(x)
    else:
        dist.broadcast(x, src=0)


def returns_early_on_rank_one():
    if dist.get_rank() == 1:
        return
    dist.barrier()


@pytest.mark.parametrize("fn,kind,hint", [
    (mismatched_collectives, "mismatched-collectives",
     "Hint: the ranks are stuck in different collectives: rank 0 in all_reduce(), rank 1 in "
     "broadcast()."),
    (returns_early_on_rank_one, "missing-from-collective",
     "Hint: rank 0 waits in barrier(), which rank 1 never joined (rank 1 had already returned "
     "from your function)."),
])
@pytest.mark.slow
def test_a_hang_in_a_collective_is_told_from_an_unmatched_send_or_recv(fn, kind, hint):
    run(int, nproc=2)  # start the job first: the short timeout is for the hang alone
    with pytest.raises(checks.CheckFailed) as info:
        checks.launch("Exercise 9.8", fn, nproc=2, timeout=5)
    msg = str(info.value)
    assert msg.startswith("Exercise 9.8: with world size 2 your code did not finish in 5s")
    assert info.value.diagnosis.kind == kind
    assert hint in msg
    assert "send or recv" not in msg
    assert f", in {fn.__name__}" in msg  # the student's frame, and not the launcher's
    assert "worker.py" not in msg and "threading.py" not in msg
    assert checks.outcome("Exercise 9.8") == "failed"


def collective_of_another_size():
    dist.all_reduce(torch.ones(10 + dist.get_rank()))


@pytest.mark.slow
def test_a_collective_the_backend_aborts_is_explained():
    """gloo does not hang on a size mismatch: it aborts the rank (no Python error)."""
    run(int, nproc=2)
    with pytest.raises(checks.CheckFailed) as info:
        checks.launch("Exercise 9.7", collective_of_another_size, nproc=2, timeout=30)
    msg = str(info.value)
    assert msg.startswith("Exercise 9.7: with world size 2 the gloo backend aborted a rank of "
                          "your job: ")
    assert "Received data size doesn't match expected size" in msg
    assert "Hint: the ranks disagree on the size of a message" in msg
    assert checks.outcome("Exercise 9.7") == "failed"


# ---- which exercises passed, for the measurement cells -----------------------------------
def test_ready_is_silent_for_an_exercise_never_checked_or_passed(capsys):
    assert checks.ready("Exercise 2.3") is True
    assert capsys.readouterr().out == ""
    checks.passed("Exercise 2.3", "all good")
    capsys.readouterr()
    assert checks.ready("Exercise 2.3") is True and checks.ready("2.3") is True
    assert capsys.readouterr().out == ""


SKIP_LINE = ("Exercise 2.3 did not pass its check in this kernel: skipping this measurement; "
             "fix it and run its check cell again\n")


@pytest.mark.parametrize("fail", [
    lambda: checks.expect_close("Exercise 2.3", torch.ones(2), torch.zeros(2), rank=0,
                                world_size=2),
    lambda: checks.expect_close("Exercise 2.3", [1.0], torch.zeros(1), rank=0, world_size=2),
    lambda: checks.expect_equal("Exercise 2.3", 3, 4, rank=1, world_size=2),
    lambda: (_ for _ in ()).throw(checks.CheckFailed("Exercise 2.3: buckets launched late")),
], ids=["expect_close", "expect_close-type", "expect_equal", "raised-by-a-lab"])
def test_a_failed_check_makes_the_measurement_skip_until_it_passes(fail, capsys):
    checks.passed("Exercise 2.3")
    with pytest.raises(checks.CheckFailed):
        fail()
    capsys.readouterr()
    assert checks.ready("Exercise 2.3") is False
    assert capsys.readouterr().out == SKIP_LINE
    assert checks.ready("Exercise 2.2") is True  # only that exercise
    checks.passed("Exercise 2.3")  # fixed, and its check run again
    capsys.readouterr()
    assert checks.ready("Exercise 2.3") is True
    assert capsys.readouterr().out == ""


def fake_run(outcome):
    def run(fn, *args, nproc, **kwargs):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    return run


def test_launch_records_stubs_timeouts_and_checks_that_never_finished(monkeypatch, capsys):
    stub_error = LaunchError("rank 0 failed", ranks=[0], errors=[
        {"rank": 0, "type": "NotImplementedError", "message": "", "traceback": "", "time": 0}])
    monkeypatch.setattr(launcher, "run", fake_run(stub_error))
    with pytest.raises(NotImplementedError):
        checks.launch("Exercise 1.4", print, nproc=2)
    assert checks.outcome("1.4") == "failed" and not checks.ready("Exercise 1.4")

    monkeypatch.setattr(launcher, "run", fake_run(LaunchTimeout("stopped", stacks={})))
    with pytest.raises(checks.CheckFailed,
                       match="(?s)did not finish in 60s.*Hint: no rank answered with its stack"):
        checks.launch("Exercise 1.5", print, nproc=2)
    assert checks.outcome("Exercise 1.5") == "failed"

    # the ranks ran, then the check itself raised something else (the student's function
    # returned None where the grader unpacks a pair): the check did not pass
    monkeypatch.setattr(launcher, "run", fake_run([None, None]))
    assert checks.launch("Exercise 1.6", print, nproc=2) == [None, None]
    assert checks.outcome("Exercise 1.6") == "checking"
    capsys.readouterr()
    assert checks.ready("Exercise 1.6") is False
    assert capsys.readouterr().out.startswith("Exercise 1.6 did not pass its check")
    checks.passed("Exercise 1.6")
    assert checks.ready("Exercise 1.6") is True


def test_check_failed_knows_its_exercise():
    assert checks.CheckFailed("Exercise 3.1: wrong").exercise == "Exercise 3.1"
    assert checks.CheckFailed("wrong", exercise="3.2").exercise == "Exercise 3.2"
    assert checks.CheckFailed("no exercise named here").exercise is None
    assert checks.outcome("Exercise 3.1") == "failed" and checks.outcome("3.2") == "failed"
    assert checks._outcomes.keys() == {"Exercise 3.1", "Exercise 3.2"}


def test_a_wrong_value_is_shown_where_it_is_outside_the_tolerance():
    """A last-bit difference comes before the real one: the message shows the real one."""
    expected = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    got = expected.clone()
    got[0] = torch.nextafter(got[0], torch.tensor(2.0, dtype=torch.float64))
    got[2] = 3.5
    with pytest.raises(checks.CheckFailed, match="flat index 2: expected 3.0, got 3.5"):
        checks.expect_close("Exercise 9.9", got, expected, rank=0, world_size=1, rtol=1e-9,
                            atol=1e-9)
    ints = torch.tensor([1, 2, 3])
    with pytest.raises(checks.CheckFailed, match="flat index 1: expected 2, got 5"):
        checks.expect_close("Exercise 9.9", torch.tensor([1, 5, 3]), ints, rank=0,
                            world_size=1)
