"""Exercise 6.4's check on 8 and 4 gloo ranks: a student-style DP x TP x PP run passes;
one that feeds every replica the whole batch, one that never averages over dp, one in
which every rank trains the whole model alone (its replica's losses come out right), one
that never splits a block over tp, and the stub fail, each with its reason."""
import pytest
import torch
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib.grading import checks, lab06

ship_by_value(__name__)


def train_3d(cfg, dp, tp, pp, batches, microbatches=2, seed=0, lr=3e-3,
             whole_batch=False, average=True, split_blocks=True):
    from course_lib.ddp import FlatDDP
    from course_lib.mesh import ParallelDims
    from course_lib.models import Block
    from course_lib.pipeline import PipelineStage, make_schedule, pipeline_step
    from course_lib.pipeline.runs import gpt_loss
    from course_lib.pipeline.stage import gpt_stage
    from course_lib.tp import parallelize_block

    dims = ParallelDims(dp=dp, tp=tp, pp=pp).build()
    try:
        s = dims.coords.pp
        module = gpt_stage(cfg, s, pp, seed)
        for block in [m for m in module.modules() if isinstance(m, Block) and split_blocks]:
            parallelize_block(block, dims.group("tp"))
        ddp = FlatDDP(module, process_group=dims.group("dp"))
        ddp.require_backward_grad_sync = False
        stage = PipelineStage(ddp, s, pp, group=dims.group("pp"))
        plan = make_schedule("1f1b", pp, microbatches)
        opt = torch.optim.AdamW(module.parameters(), lr=lr)
        size = len(batches[0][0]) // dp
        rows = slice(None) if whole_batch else slice(dims.coords.dp * size,
                                                     (dims.coords.dp + 1) * size)
        losses = []
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            loss = pipeline_step(stage, plan, batch=x[rows] if stage.is_first else None,
                                 targets=y[rows] if stage.is_last else None,
                                 loss_fn=gpt_loss(cfg.vocab) if stage.is_last else None)
            if average:
                ddp.sync_gradients()
            opt.step()
            losses.append(None if loss is None else loss.item())
        return losses
    finally:
        dims.destroy()


def every_replica_reads_the_whole_batch(cfg, dp, tp, pp, batches):
    return train_3d(cfg, dp, tp, pp, batches, whole_batch=True)


def never_averaging_over_dp(cfg, dp, tp, pp, batches):
    return train_3d(cfg, dp, tp, pp, batches, average=False)


def every_rank_trains_alone(cfg, dp, tp, pp, batches, seed=0, lr=3e-3):
    """No 3D at all: the whole model on the whole batch, its replica's rows' loss reported."""
    from course_lib.models import GPT
    from course_lib.pipeline.runs import gpt_loss

    model, loss_fn = GPT(cfg, seed), gpt_loss(cfg.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    size, dp_i = len(batches[0][0]) // dp, dist.get_rank() // tp % dp
    rows, losses = slice(dp_i * size, (dp_i + 1) * size), []
    for x, y in batches:
        with torch.no_grad():
            losses.append(loss_fn(model(x[rows]), y[rows]).item())
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    return losses


def blocks_never_split_over_tp(cfg, dp, tp, pp, batches):
    return train_3d(cfg, dp, tp, pp, batches, split_blocks=False)


@pytest.mark.slow  # three 4-rank trainings in the judge; make test runs the check on the solution in nbval
def test_a_student_style_run_passes_on_three_meshes(sandbox):
    assert "(2, 2, 2)" in judged(sandbox, lab06.check_three_d, train_3d, seed=7)


@pytest.mark.parametrize("wrong,fragment", [
    (every_replica_reads_the_whole_batch, "reported .* at step 0.*must train on rows"),
    (never_averaging_over_dp, "at step 1.*average each gradient over its data-parallel group"),
])
def test_wrong_runs_are_named(wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=f"(?s){fragment}"):
        judged(sandbox, lab06.check_three_d, wrong, meshes=((2, 1, 2),))


@pytest.mark.parametrize("wrong,mesh", [(every_rank_trains_alone, (2, 1, 2)),
                                        (blocks_never_split_over_tp, (1, 2, 2))])
def test_right_losses_from_a_rank_doing_more_than_its_share_fail(wrong, mesh, sandbox):
    with pytest.raises(checks.CheckFailed, match="did [0-9.]+x its share of the matmul FLOPs"):
        judged(sandbox, lab06.check_three_d, wrong, meshes=(mesh,))


def test_the_stub_says_not_implemented():
    def stub(cfg, dp, tp, pp, batches):
        raise NotImplementedError("Exercise 6.4: 3D")

    with pytest.raises(NotImplementedError, match="Exercise 6.4 is not implemented"):
        lab06.check_three_d(stub)
