"""An asynchronous save holds the state as it was when save() returned, while the loop
changes it; a second save waits for the first. Per-stage checkpoints: each stage saves
alone, and the newest step every stage committed is the one to resume from."""
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import run
from course_lib.checkpoint import (AsyncCheckpointer, ShardedTensor, consolidate, latest,
                                   latest_complete, save_stage)

ship_by_value(__name__)


def train_while_saving(root):
    rank, world = dist.get_rank(), dist.get_world_size()
    weights = torch.arange(12.0).reshape(4, 3)[rank * 2:(rank + 1) * 2].clone()
    saver = AsyncCheckpointer()
    for step in range(3):
        saver.save({"w": ShardedTensor(weights, (4, 3), (rank * 2, 0)), "step": step},
                   f"{root}/step_{step:06d}")
        weights += 100  # the loop goes on while the thread writes
    saver.wait()
    return saver.blocked_s


def test_an_async_save_keeps_the_state_of_its_call(tmp_path):
    blocked = run(train_while_saving, tmp_path, nproc=2, timeout=120)
    assert all(b > 0 for b in blocked)
    for step in range(3):
        got = consolidate(tmp_path / f"step_{step:06d}")
        assert torch.equal(got["w"], torch.arange(12.0).reshape(4, 3) + 100 * step)
        assert got["step"] == step
    assert latest(tmp_path) == tmp_path / "step_000002"


def stage_saves(root, last_step_of_stage):
    stage = dist.get_rank()
    for step in range(1, last_step_of_stage[stage] + 1):  # no barrier between the stages
        save_stage({"layers": torch.full((2,), float(10 * stage + step)), "step": step},
                   root, step, stage)
    return stage


def test_each_stage_saves_alone_and_the_newest_complete_step_wins(tmp_path):
    # stage 1 dies after step 2, the others reach step 3
    run(stage_saves, tmp_path, [3, 2, 3], nproc=3, timeout=120)
    step = latest_complete(tmp_path, n_stages=3)
    assert step == tmp_path / "step_000002"
    for stage in range(3):
        got = consolidate(step / f"stage_{stage:03d}")
        assert torch.equal(got["layers"], torch.full((2,), float(10 * stage + 2)))
    assert latest_complete(tmp_path, n_stages=4) is None


def test_a_restart_plan_keeps_the_newest_complete_steps_and_clears_the_dead_runs_saves(tmp_path):
    """Stage 1 died after step 2: step 3 is the dead run's, and the resumed run's save of
    step 3 is refused until the plan has removed it."""
    import shutil

    import pytest

    from course_lib.checkpoint import CheckpointError
    from course_lib.checkpoint.pipeline import plan_restart

    for stage, last in enumerate([3, 2, 3]):
        for step in range(1, last + 1):
            save_stage({"layers": torch.zeros(2)}, tmp_path, step, stage)
    (tmp_path / "notes.txt").write_text("beside the steps\n")
    resume, remove = plan_restart(tmp_path, n_stages=3, keep=1)
    assert resume == tmp_path / "step_000002"
    assert remove == [tmp_path / "step_000001", tmp_path / "step_000003"]
    assert plan_restart(tmp_path, n_stages=3, keep=2)[1] == [tmp_path / "step_000003"]
    assert plan_restart(tmp_path / "missing", n_stages=3) == (None, [])
    with pytest.raises(ValueError, match="keep must be a positive number"):
        plan_restart(tmp_path, n_stages=3, keep=0)
    with pytest.raises(CheckpointError, match="already holds a committed checkpoint"):
        save_stage({"layers": torch.ones(2)}, tmp_path, 3, 0)
    for path in remove:
        shutil.rmtree(path)
    save_stage({"layers": torch.ones(2)}, tmp_path, 3, 0)
    assert (tmp_path / "notes.txt").exists()


def test_stages_saved_on_one_partition_load_into_another_and_into_the_whole_model(tmp_path):
    """A stage keeps the GPT's own names: 3 stages' checkpoints (AdamW after a step) fill
    the whole model and a 2-stage cut of it, every parameter and moment as saved."""
    from course_lib.checkpoint import load_stages, state_of
    from course_lib.checkpoint.state import ensure_optimizer_state
    from course_lib.models import GPT, GPTConfig
    from course_lib.pipeline.stage import GPTStage

    cfg = GPTConfig(vocab=11, dim=8, layers=4, heads=2, seq_len=6)
    saved = {}
    for s, pieces in enumerate((range(0, 2), range(2, 4), range(4, 6))):
        stage = GPTStage(cfg, pieces, seed=s)  # seeds differ: every value is traceable
        opt = torch.optim.AdamW(stage.parameters(), lr=0.1)
        sum(p.sum() for p in stage.parameters()).backward()
        opt.step()
        state = state_of(stage, opt)
        saved.update({k: v.clone() for k, v in state.items()})
        save_stage(state, tmp_path, 7, s)
    for model in (GPT(cfg, seed=9), GPTStage(cfg, range(1, 5), seed=9)):
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        ensure_optimizer_state(model, opt)
        state = state_of(model, opt)
        load_stages(state, tmp_path / "step_000007")
        for name, value in state.items():
            assert torch.equal(value, saved[name]), name
