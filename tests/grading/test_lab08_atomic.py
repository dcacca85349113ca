"""Exercise 8.3's check: the solution passes (also as the gradebook's judge decides), the
stub and each plausible wrong answer fail with its own reason; the library's save is
refused by the judge."""
import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib.checkpoint.files import COMMITTED, INDEX, write_atomically
from course_lib.checkpoint.save import _index, commit, layout, refuse_committed, write_data
from course_lib.grading import checks
from course_lib.grading.lab08.atomic import check_atomic_save

ship_by_value(__name__)


def sharded_save(state, path, group, gather=True, commit_on=0, refuse=True, barrier=True,
                 marker_first=False, replicated_everywhere=False, global_rank=False,
                 reverse=False):
    path = Path(path)
    rank = dist.get_rank() if global_rank else dist.get_rank(group)
    if refuse:
        refuse_committed(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, described, values = layout(state, path, rank)
    if replicated_everywhere:  # the plain tensor too, on every rank (left out of the index)
        tensors = tensors + ([] if rank == 0 else [state["bias"]])
    write_data(path, rank, tensors[::-1] if reverse else tensors)
    everyone = [described]
    if gather:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, described, group=group)
    if commit_on is None or rank == commit_on:
        if marker_first:
            write_atomically(path / COMMITTED, b"")
            write_atomically(path / INDEX, json.dumps(_index(path, everyone, values)).encode())
        else:
            commit(path, everyone, values)
    if barrier:
        dist.barrier(group=group)


def gathered_on_rank_0(state, path, group):
    path, rank = Path(path), dist.get_rank(group)
    refuse_committed(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, described, values = layout(state, path, rank)
    write_data(path, rank, tensors)
    everyone = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(described, everyone, group=group, group_dst=0)
    if rank == 0:
        commit(path, everyone, values)
    dist.barrier(group=group)


def test_the_solution_passes_as_judged(sandbox):
    assert "a committed directory refused" in judged(sandbox, check_atomic_save, sharded_save)


def test_a_gather_to_rank_0_passes(capsys):
    check_atomic_save(gathered_on_rank_0)
    assert "✓ Exercise 8.3 passed" in capsys.readouterr().out


@pytest.mark.slow  # a 3-rank job each: CI runs them after make test
@pytest.mark.parametrize("options, reason", [
    (dict(gather=False), "index.json was written before the data file rank00002.bin"),
    (dict(gather=False, commit_on=None), r"index.json describes the pieces of rank\(s\) \[2\]"),
    (dict(barrier=False), r"returned on rank\(s\) \[1, 2\] before the checkpoint was committed"),
    (dict(refuse=False), "a second sharded_save .* did not raise on rank.* and changed"),
    (dict(marker_first=True), "COMMITTED was written before index.json"),
    (dict(replicated_everywhere=True), "the data files hold 348 bytes where the state is "
                                       "236.*2 more copies of the replicated tensor"),
    (dict(reverse=True), "course_lib's load does not read back the 'w' that was saved"),
    (dict(global_rank=True), "ranks 1 and 2 of 3 as a group.*dist.get_rank.group."),
])
def test_wrong_answers_fail_with_their_reason(options, reason):
    with pytest.raises(checks.CheckFailed, match="Exercise 8.3") as info:
        check_atomic_save(lambda s, p, g: sharded_save(s, p, g, **options))
    assert re.search(reason, str(info.value), re.S), str(info.value)


def test_the_stub_says_not_implemented():
    def stub(state, path, group):
        raise NotImplementedError

    with pytest.raises(NotImplementedError, match="Exercise 8.3 is not implemented"):
        check_atomic_save(stub)


def test_the_library_passes_the_comparison(capsys):
    from course_lib.checkpoint.save import save

    check_atomic_save(save)
    assert "✓ Exercise 8.3 passed" in capsys.readouterr().out


def test_the_library_is_refused(sandbox):
    from course_lib.checkpoint.save import save

    with pytest.raises(checks.CheckFailed, match="course_lib.s own implementation"):
        judged(sandbox, check_atomic_save, save)
