"""``run(..., max_restarts=N)`` under real torchrun with gloo: a rank that is killed
(SIGKILL) or raises brings every rank down and back as fresh processes, until the
function returns on all of them or the restarts run out."""
import os
import signal
import textwrap

import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import LaunchError, run, run_script

ship_by_value(__name__)


def note_and_maybe_die(log_dir, victim, failing_attempts, how):
    """Every rank notes (attempt, pid) in its own file; ``victim`` dies in the
    attempts below ``failing_attempts``, after one all-reduce with its peers."""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = dist.get_rank()
    with open(os.path.join(log_dir, f"rank{rank}.txt"), "a") as f:
        f.write(f"{attempt} {os.getpid()}\n")
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    if rank == victim and attempt < failing_attempts:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"rank {rank} fails in attempt {attempt}")
    return attempt, total.item()


def attempts_of(log_dir, rank):
    lines = (log_dir / f"rank{rank}.txt").read_text().split()
    return [int(a) for a in lines[0::2]], [int(p) for p in lines[1::2]]


# three ranks started twice: make test raises, CI's `make test-slow` kills as well
@pytest.mark.parametrize("how", [pytest.param("kill", marks=pytest.mark.slow), "raise"])
def test_a_rank_that_dies_brings_every_rank_back_fresh(tmp_path, how):
    out = run(note_and_maybe_die, str(tmp_path), 1, 1, how, nproc=3, max_restarts=2, timeout=90)
    assert out.restarts == 1
    assert list(out) == [(1, 3.0)] * 3  # the last attempt's values, every rank in it
    for rank in range(3):
        attempts, pids = attempts_of(tmp_path, rank)
        assert attempts == [0, 1]  # the survivors were restarted too, not only the victim
        assert pids[0] != pids[1]  # fresh processes: nothing survives but what was saved


@pytest.mark.slow  # a job started three times: CI runs it after make test
def test_a_job_that_keeps_failing_raises_the_last_attempts_error(tmp_path):
    with pytest.raises(LaunchError) as caught:
        run(note_and_maybe_die, str(tmp_path), 1, 99, "raise", nproc=2, max_restarts=2,
            timeout=90)
    assert "fails in attempt 2" in str(caught.value)  # not attempt 0's record
    assert caught.value.errors[0]["rank"] == 1  # the cause; rank 0 failed after it
    assert any("restarted the ranks 2 times" in note for note in caught.value.__notes__)
    assert attempts_of(tmp_path, 0)[0] == [0, 1, 2]


@pytest.mark.slow  # a job started twice: CI runs it after make test
def test_a_rank_killed_in_every_attempt_is_named_as_the_cause(tmp_path):
    with pytest.raises(LaunchError) as caught:
        run(note_and_maybe_die, str(tmp_path), 0, 99, "kill", nproc=2, max_restarts=1,
            timeout=90)
    # a killed rank writes no record: it is named all the same, and its peer's broken
    # connection is a consequence, not the cause
    assert str(caught.value).startswith("rank 0 failed with")
    assert "no traceback" in str(caught.value)
    assert caught.value.errors[0]["rank"] == 0
    assert any("restarted the ranks 1 times" in note for note in caught.value.__notes__)
    assert attempts_of(tmp_path, 1)[0] == [0, 1]


def test_max_restarts_must_be_a_count():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_restarts"):
            run(note_and_maybe_die, "/nonexistent", 0, 0, "raise", max_restarts=bad)


@pytest.mark.slow  # a fresh torchrun job started twice: CI runs it after make test
def test_a_script_restarts_too(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        import torch.distributed as dist
        from course_lib.runtime.backend import init_distributed
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        open(os.path.join({str(tmp_path)!r}, "attempts"), "a").write(f"{{attempt}}\\n")
        init_distributed()
        if dist.get_rank() == 1 and attempt == 0:
            sys.exit("rank 1 gives up in attempt 0")
        dist.barrier()
    """))
    out = run_script(script, nproc=2, max_restarts=1, timeout=90)
    assert out.restarts == 1
    assert sorted((tmp_path / "attempts").read_text().split()) == ["0", "0", "1", "1"]


def killed_while_peers_wait(victim):
    """``victim`` dies while the other ranks are inside an all-reduce with it."""
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("restarts", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_killed_rank_is_named_not_the_peers_it_broke(restarts):
    """The peers fail first, on their broken connection, with a record each; the rank that
    was killed wrote none, and is still the one named (the last rank: torchrun's summary
    may name a peer, so the launcher cannot rely on it)."""
    run(int, nproc=3)  # a warm job's earlier calls left results: not this call's
    with pytest.raises(LaunchError) as caught:
        run(killed_while_peers_wait, 2, nproc=3, max_restarts=restarts, timeout=60)
    assert str(caught.value).startswith("rank 2 failed with")
    assert "no traceback" in str(caught.value)
    assert 2 in caught.value.ranks


def leaves_quietly():
    import sys

    if dist.get_rank() == 1:
        sys.exit(0)
    return dist.get_rank()


def test_a_rank_that_exits_without_returning_is_reported():
    with pytest.raises(LaunchError, match=r"rank 1 failed .* ended its process with sys.exit"):
        run(leaves_quietly, nproc=2, max_restarts=1, timeout=60)
