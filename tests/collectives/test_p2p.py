"""Lab 00's reference patterns pass Lab 00's checks; broken versions fail them, decided
as the gradebook's judge decides (in the sandbox), with the message a student would need."""
import time

import pytest
import torch
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib import comm, run
from course_lib.collectives import p2p
from course_lib.grading import checks, lab00

ship_by_value(__name__)


def test_reference_implementations_pass_their_checks(capsys):
    lab00.check_ping_pong(p2p.ping_pong)
    lab00.check_token_ring(p2p.token_ring)
    lab00.check_ring_shift(p2p.ring_shift)
    out = capsys.readouterr().out
    for ex in ("0.1", "0.2", "0.3"):
        assert f"✓ Exercise {ex} passed" in out


def test_world_size_one_needs_no_messages():
    x = torch.arange(5.0)
    assert torch.equal(run(p2p.token_ring, x, nproc=1)[0], x)
    assert torch.equal(run(p2p.ring_shift, x, nproc=1)[0], x)


def test_measure_ping_pong_reports_sizes_on_rank_zero():
    out = run(p2p.measure_ping_pong, p2p.ping_pong, [16, 4096], 3, 1, nproc=2)
    assert list(out[0]) == [16, 4096] and all(t > 0 for t in out[0].values())
    assert out[1] == {}


def echo_plus_one(payload, iters):
    rank, buf, times = dist.get_rank(), torch.empty_like(payload), []
    for _ in range(iters):
        if rank == 0:
            comm.send(payload, 1)
            comm.recv(buf, 1)
            times.append(1e-3)
        elif rank == 1:
            comm.recv(buf, 0)
            comm.send(buf + 1, 0)
    return (buf if rank < 2 else None), times


def ring_without_adding(token):
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        comm.send(token, 1)
        back = torch.empty_like(token)
        comm.recv(back, world - 1)
        return back
    got = torch.empty_like(token)
    comm.recv(got, rank - 1)
    comm.send(got, (rank + 1) % world)
    return got


def shift_twice(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.empty_like(x)
    for _ in range(2):  # right answer, twice the messages
        comm.exchange(sends=[(x, (rank + 1) % world)], recvs=[(out, (rank - 1) % world)])
    return out


def shift_send_first(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.empty_like(x)
    comm.send(x, (rank + 1) % world)
    comm.recv(out, (rank - 1) % world)
    return out


def test_broken_solutions_fail_with_actionable_messages(sandbox):
    with pytest.raises(checks.CheckFailed, match="Exercise 0.1: rank 0 .* the echoed payload"):
        judged(sandbox, lab00.check_ping_pong, echo_plus_one, world_sizes=(2,))
    with pytest.raises(checks.CheckFailed, match="(?s)Exercise 0.2: rank 0 .*Hint: rank r > 0 adds r"):
        judged(sandbox, lab00.check_token_ring, ring_without_adding, world_sizes=(3,))
    with pytest.raises(checks.CheckFailed, match=r"\(messages sent, received\): expected \(1, 1\), "
                                                 r"got \(2, 2\)"):
        judged(sandbox, lab00.check_ring_shift, shift_twice, world_sizes=(2,))
    # the same verdict in a notebook's kernel, where the check runs in-process
    with pytest.raises(checks.CheckFailed, match="(?s)Exercise 0.2: rank 0 .*Hint: rank r > 0 adds r"):
        lab00.check_token_ring(ring_without_adding, world_sizes=(3,))


@pytest.mark.slow  # waits out a timeout: `make test-slow`
def test_a_ring_where_every_rank_sends_first_is_told_it_did_not_finish(sandbox):
    with pytest.raises(checks.CheckFailed, match="did not finish"):
        judged(sandbox, lab00.check_ring_shift, shift_send_first, world_sizes=(3,), timeout=6)


def timed_once_around_the_loop(payload, iters):
    """Right messages, but one time for the whole loop."""
    rank, buf = dist.get_rank(), torch.empty_like(payload)
    start = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            comm.send(payload, 1)
            comm.recv(buf, 1)
        elif rank == 1:
            comm.recv(buf, 0)
            comm.send(buf, 0)
    return (buf if rank < 2 else None), ([time.perf_counter() - start] if rank == 0 else [])


def timed_backwards(payload, iters):
    """Right messages, one time per round trip, start minus end."""
    rank, buf, times = dist.get_rank(), torch.empty_like(payload), []
    for _ in range(iters):
        if rank == 0:
            start = time.perf_counter()
            comm.send(payload, 1)
            comm.recv(buf, 1)
            times.append(start - time.perf_counter())
        elif rank == 1:
            comm.recv(buf, 0)
            comm.send(buf, 0)
    return (buf if rank < 2 else None), times


@pytest.mark.parametrize("wrong,fragment", [
    (timed_once_around_the_loop, r"(?s)expected 3 of them, got 1\..*Hint: one time for all "
                                 r"iterations: is the clock read around the whole loop"),
    (timed_backwards, r"(?s)must be positive durations.*Hint: every time is negative: "
                      r"subtract the start from the end"),
])
def test_ping_pong_timing_mistakes_are_named(wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab00.check_ping_pong, wrong, world_sizes=(2,))


def test_stubs_say_which_exercise_is_missing():
    def stub(*args):
        raise NotImplementedError

    for check, ex in ((lab00.check_ping_pong, "0.1"), (lab00.check_token_ring, "0.2"),
                      (lab00.check_ring_shift, "0.3")):
        with pytest.raises(NotImplementedError, match=f"Exercise {ex} is not implemented"):
            check(stub, world_sizes=(2,))
        assert checks.outcome(f"Exercise {ex}") == "failed"
