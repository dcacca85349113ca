"""An exact resume: a rank SIGKILLed mid-run, torchrun bringing every rank back, and the
losses of the resumed run equal, bit for bit, to those of the uninterrupted run."""
import pytest
import torch

from conftest import ship_by_value
from course_lib import run
from course_lib.checkpoint import DataCursor
from course_lib.checkpoint.resumable import KILLED_AT, step_log, train

ship_by_value(__name__)


def test_a_cursor_sought_to_a_saved_position_reads_the_same_batches():
    inputs = torch.arange(50).view(25, 2)
    reader = DataCursor(inputs, inputs + 100, batch=2, rank=1, world=3, seed=4)
    for _ in range(7):  # past the end of epoch 0 (4 global batches of 6 rows)
        reader.next()
    saved = reader.position()
    assert saved == {"data.epoch": 1, "data.taken": 3}
    want = [reader.next() for _ in range(5)]
    again = DataCursor(inputs, inputs + 100, batch=2, rank=1, world=3, seed=4)
    again.seek(saved)
    for (x, y), (wx, wy) in zip((again.next() for _ in range(5)), want):
        assert torch.equal(x, wx) and torch.equal(y, wy)


def test_the_ranks_of_a_cursor_split_each_global_batch_and_epochs_reshuffle():
    inputs = torch.arange(14)
    seen = []
    for epoch in range(2):
        rows = []
        for rank in range(3):
            cursor = DataCursor(inputs, inputs, batch=2, rank=rank, world=3, seed=0)
            cursor.seek({"data.epoch": epoch, "data.taken": 0})
            rows += [cursor.next()[0], cursor.next()[0]]
        both = torch.cat(rows)
        assert len(set(both.tolist())) == 12  # 2 global batches of 6 distinct rows
        seen.append(both)
    assert not torch.equal(seen[0].sort().values, seen[1].sort().values) or not torch.equal(
        seen[0], seen[1])


@pytest.mark.slow  # a torchrun restart of a killed rank (10 s); CI runs it after make test
def test_a_killed_rank_resumes_to_the_same_losses_bit_for_bit(tmp_path):
    clean = run(train, tmp_path / "clean", 9, 3, nproc=3, timeout=180)
    hit = run(train, tmp_path / "hit", 9, 3, (2, 7), nproc=3, max_restarts=1, timeout=240)
    assert hit.restarts == 1 and {r["attempt"] for r in hit} == {1}
    assert {r["resumed_from"] for r in hit} == {6}  # the checkpoint after step 6, not 0
    assert (tmp_path / "hit" / KILLED_AT).exists()
    assert all(r["resumed_after_s"] > 0 for r in hit)
    losses = clean[0]["losses"]
    assert len(losses) == 9 and len(set(losses)) > 1
    for result in hit:
        assert result["losses"] == losses  # floats compared exactly
    steps, killed = step_log(tmp_path / "hit")
    # attempt 0 completed steps 0-6 (rank 2 died inside step 7, whose backward rank 0 could
    # then never finish); the last checkpoint holds 6 steps, so attempt 1 ran steps 6-8:
    # step 6 was done twice, the work the failure cost
    assert [(s["attempt"], s["step"]) for s in steps] == [(0, i) for i in range(7)] + [
        (1, i) for i in range(6, 9)]
    assert steps[6]["end"] <= killed <= steps[7]["start"]
