"""Door 5: settings drawn in the judge. Every prediction, every check whose cases come
from a seed, and the Lab 00-01 checks on ranks also run, in the gradebook only, on
settings drawn from the class's secret for each student and never shown: the
solutions pass them, a table of the visible cases' answers does not, and the message
of a failure there holds none of the drawn numbers."""
import random

import pytest
import torch
import torch.distributed as dist

from conftest import judged, ship_by_value
from mini_lab import TOKEN_RING
from course_lib import comm
from course_lib.grading import checks, lab00, lab01, lab03
from course_lib.grading.hidden import class_secret
from course_lib.grading.hidden import failure as hidden_failure
from course_lib.grading.hidden import seed as hidden_seed
from test_predictions import PREDICTIONS

ship_by_value(__name__)
SEEDS = range(12)


@pytest.mark.parametrize("number,check,right,_", PREDICTIONS, ids=[p[0] for p in PREDICTIONS])
def test_each_prediction_s_hidden_settings_are_new_and_the_solution_passes_them(
        capsys, number, check, right, _):
    visible = set(check.steps.__defaults__[0])
    for seed in SEEDS:
        drawn = check.hidden(random.Random(seed))["cases"]
        assert not set(drawn) & visible, (seed, drawn)
        check(right, cases=drawn)
        assert f"✓ Prediction {number} passed" in capsys.readouterr().out
    assert check.hidden(random.Random(1)) != check.hidden(random.Random(2))


@pytest.mark.parametrize("check,right", [
    (lab03.check_param_count, lambda V, D, T, N: N * (12 * D * D + 10 * D) + D * (V + T)
     + 2 * D + V * (D + 1)),
    (lab03.check_shard_bounds, lambda numel, rank, world: (
        rank * max(-(-numel // world), 1), (rank + 1) * max(-(-numel // world), 1),
        max(-(-numel // world) * world, world))),
])
def test_a_reseeded_check_draws_other_cases_and_the_solution_passes_them(capsys, check, right):
    for seed in SEEDS[:4]:
        check(right, **check.hidden(random.Random(seed)))
        assert "passed" in capsys.readouterr().out


def test_the_seed_depends_on_the_secret_the_student_and_the_exercise(tmp_path, monkeypatch):
    seeds = {hidden_seed(secret, student, ex) for secret in ("a", "b")
             for student in ("ada", "bo") for ex in ("Exercise 1.1", "Prediction 1.1")}
    assert len(seeds) == 8
    assert hidden_seed("a", "ada", "exercise 1.1") == hidden_seed("a", "ada", "Exercise 1.1")
    monkeypatch.delenv("COURSE_LIB_GRADING_SECRET", raising=False)
    key = tmp_path / "grades" / "hidden-settings.key"
    first = class_secret(key)
    assert len(first) == 32 and class_secret(key) == first  # made once, then reused
    assert key.stat().st_mode & 0o077 == 0
    from concurrent.futures import ThreadPoolExecutor

    racing = tmp_path / "slices" / "hidden-settings.key"  # an array job's slices start at once
    with ThreadPoolExecutor(8) as pool:
        assert len(set(pool.map(lambda _: class_secret(racing), range(8)))) == 1
    assert [p.name for p in racing.parent.iterdir()] == ["hidden-settings.key"]
    monkeypatch.setenv("COURSE_LIB_GRADING_SECRET", "from the environment")
    assert class_secret(key) == "from the environment"


def test_a_failure_on_hidden_settings_shows_none_of_their_numbers():
    exc = checks.CheckFailed("Prediction 1.1: for rank 3 of the ring all-reduce of "
                             "N = 1,234,568 bytes on K = 7 ranks you predicted 12; it is "
                             "2,116,402.3.\nWhy: each step sends one chunk of N/K bytes, "
                             "not 4096 of them")
    told = hidden_failure("Prediction 1.1", exc)
    assert told.startswith("Prediction 1.1: the settings shown in the notebook passed, but "
                           "settings the grader drew for this submission (not shown) did not")
    assert not any(number in told for number in ("1,234,568", "7", "12", "2,116", "4096", "3"))
    assert "Why: each step sends one chunk of N/K bytes" in told


# ---- through the judge, with the student's code in the sandbox -------------------------------
def table_of_visible_bytes(algorithm, n, k, rank):
    """What a student who read BYTES_CASES and the numbers its failures print hands in
    (the grader is not in the sandbox: the table is copied into the notebook): the
    answers of the visible cases, and a guess elsewhere."""
    table = {("naive", 480000, 8, 0): 3360000, ("naive", 480000, 8, 3): 480000,
             ("ring", 480000, 8, 5): 840000, ("ring", 3360, 3, 0): 4480,
             ("naive", 3360, 3, 2): 3360, ("ring", 480, 2, 1): 480, ("naive", 480, 5, 0): 1920,
             ("ring", 480000, 5, 4): 768000, ("naive", 3360, 1, 0): 0, ("ring", 3360, 1, 0): 0}
    return table.get((algorithm, n, k, rank), n)


def ring_shift_by_pattern(x):
    """Lab 00's visible input is rank r + j/1000: this 'shift' rebuilds the left
    neighbour's tensor from that pattern and sends one token message each way."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm.exchange(sends=[(x[:1].clone(), (rank + 1) % world)],
                  recvs=[(torch.empty(1), (rank - 1) % world)])
    return torch.full((x.numel(),), float((rank - 1) % world)) + torch.arange(x.numel()) * 1e-3


def ring_shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.empty_like(x)
    comm.exchange(sends=[(x, (rank + 1) % world)], recvs=[(out, (rank - 1) % world)])
    return out


@pytest.mark.notebook
def test_a_table_of_the_visible_cases_passes_them_and_fails_the_hidden_ones(sandbox):
    from course_lib.grading.lab01.predictions import check_bytes_prediction

    assert "passed" in judged(sandbox, check_bytes_prediction, table_of_visible_bytes)
    with pytest.raises(checks.CheckFailed, match="drew for this submission") as failed:
        judged(sandbox, check_bytes_prediction, table_of_visible_bytes, seed=11)
    assert "you predicted #; it is #" in str(failed.value)


@pytest.mark.notebook
def test_a_shift_rebuilt_from_the_visible_pattern_fails_the_hidden_input_and_a_real_one_passes(
        sandbox):
    assert "passed" in judged(sandbox, lab00.check_ring_shift, ring_shift_by_pattern,
                              world_sizes=(2,))
    with pytest.raises(checks.CheckFailed, match="drew for this submission"):
        judged(sandbox, lab00.check_ring_shift, ring_shift_by_pattern, world_sizes=(2,), seed=5)
    line = judged(sandbox, lab00.check_ring_shift, ring_shift, world_sizes=(2,), seed=5)
    assert line.endswith("and on settings drawn for this submission)")


def all_reduce_for_the_visible_sizes_only(tensor, op):
    """A naive all-reduce that only works for the sizes the notebook shows."""
    if tensor.numel() not in (1, 7, 1001):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    reduce = torch.add if op == dist.ReduceOp.SUM else torch.maximum
    if rank == 0:
        for peer in range(1, world):
            other = torch.empty_like(tensor)
            comm.recv(other, peer)
            tensor.copy_(reduce(tensor, other))
        for peer in range(1, world):
            comm.send(tensor, peer)
    else:
        comm.send(tensor, 0)
        comm.recv(tensor, 0)


@pytest.mark.notebook
def test_a_collective_written_for_the_visible_sizes_fails_a_drawn_size(sandbox):
    assert "passed" in judged(sandbox, lab01.check_naive_all_reduce,
                              all_reduce_for_the_visible_sizes_only, world_sizes=(2,))
    with pytest.raises(checks.CheckFailed, match="drew for this submission"):
        judged(sandbox, lab01.check_naive_all_reduce, all_reduce_for_the_visible_sizes_only,
               world_sizes=(2,), seed=3)


def ping_pong(payload, iters):
    import time

    rank, times = dist.get_rank(), []
    buf = payload.clone()
    for _ in range(iters):
        start = time.perf_counter()
        if rank == 0:
            comm.send(buf, 1)
            comm.recv(buf, 1)
            times.append(time.perf_counter() - start)
        elif rank == 1:
            comm.recv(buf, 0)
            comm.send(buf, 0)
    return buf, times


exec(TOKEN_RING, globals())  # the mini lab's solution: token_ring(token)


def token_ring_from_its_own_token(token):
    """Sends as a ring does, but returns its own token plus the sum: with every rank
    handed the same token (the visible setting) that is the right number."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    received = torch.empty_like(token)
    if rank == 0:
        comm.send(token, right)
        comm.recv(received, left)
        return token + world * (world - 1) // 2
    comm.recv(received, left)
    comm.send(received + rank, right)
    return token + rank * (rank + 1) // 2


@pytest.mark.notebook
def test_lab00_s_solutions_pass_their_hidden_settings_and_a_made_up_token_does_not(sandbox):
    for check, solution in ((lab00.check_ping_pong, ping_pong), (lab00.check_token_ring, token_ring),
                            (lab00.check_ring_shift, ring_shift)):
        assert "drawn for this submission" in judged(sandbox, check, solution, seed=2)
    assert "passed" in judged(sandbox, lab00.check_token_ring, token_ring_from_its_own_token)
    with pytest.raises(checks.CheckFailed, match="drew for this submission"):
        judged(sandbox, lab00.check_token_ring, token_ring_from_its_own_token, seed=2)


def ping_pong_echoing_zeros(payload, iters):
    """Rank 1 sends zeros back and rank 0 returns its own payload: the counts are right."""
    rank, times = dist.get_rank(), []
    buf = payload.clone()
    for _ in range(iters):
        if rank == 0:
            comm.send(buf, 1)
            comm.recv(torch.empty_like(buf), 1)
            times.append(1e-4)
        elif rank == 1:
            comm.recv(buf, 0)
            comm.send(torch.zeros_like(buf), 0)
    return payload.clone(), times


@pytest.mark.notebook
def test_an_echo_is_what_rank_0_received_not_what_it_returns(sandbox):
    with pytest.raises(checks.CheckFailed, match="the last message rank 0 received"):
        judged(sandbox, lab00.check_ping_pong, ping_pong_echoing_zeros, world_sizes=(2,))
