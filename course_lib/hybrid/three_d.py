"""The course GPT on all three dims at once: DP x TP x PP (Lab 06).

On ``dp * tp * pp`` ranks laid out as :class:`~course_lib.mesh.ParallelDims` lays them
out (tp fastest, then dp, then pp), rank (pp_i, dp_i, tp_i):

- builds pipeline stage pp_i of the GPT (Lab 04's partition of its pieces) and makes
  every block of it tensor parallel over its tp group (Lab 05: attention by heads, the
  MLP column then row; embeddings, LayerNorms and head whole on each tp rank);
- passes activations forward and gradients back along its pp group, to the rank of
  the next (previous) stage with the same (dp_i, tp_i): the tp ranks of a stage hold
  the same activation, so each sends its own copy to its own counterpart;
- averages its gradients over its dp group once the stage's last backward is done
  (each tp rank averages its own shards with the replicas' same shards);
- takes rows dp_i of the global batch, split into microbatches by the 1F1B schedule:
  only the first stage reads the tokens and only the last the targets.

Eight ranks as (pp, dp, tp) = (2, 2, 2) train like one process on the whole batch::

    out = run(train_strategy, "dp_tp_pp", cfg, dp=2, inner=4, tp=2, nproc=8)
"""
from __future__ import annotations

import torch

from course_lib.mesh import ParallelDims
from course_lib.models import Block
from course_lib.runtime.backend import current_device


def tp_dense_state(module):
    """{name: full tensor} of ``module``'s parameters, each tensor-parallel layer's
    shards gathered over its tp group (every rank of the group calls it)."""
    from course_lib.tp import ColumnParallelLinear, RowParallelLinear

    state = {n: p.detach().clone() for n, p in module.named_parameters()}
    for prefix, sub in module.named_modules():
        if isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
            for name, tensor in sub.dense_state().items():
                state[f"{prefix}.{name}"] = tensor
    return state


def stage_on_mesh(cfg, s, pp, seed, lr, tp_group, replica_group, pp_group, collectives,
                  attend=None, pos_offset=0):
    """(stage module in FlatDDP, its PipelineStage, optimizer): stage ``s`` of ``pp``, its
    blocks tensor parallel over ``tp_group``, its gradients averaged over
    ``replica_group`` (the ranks holding the same weights) after the pipeline's step.
    ``attend``: the attention of each block's local heads (4D: the ring over cp);
    ``pos_offset``: where the first stage's tokens sit in the sequence."""
    from course_lib.ddp import FlatDDP
    from course_lib.pipeline import PipelineStage
    from course_lib.pipeline.stage import gpt_stage
    from course_lib.tp import parallelize_block

    module = gpt_stage(cfg, s, pp, seed).to(current_device())
    module.pos_offset = pos_offset
    for block in [m for m in module.modules() if isinstance(m, Block)]:
        parallelize_block(block, tp_group, collectives=collectives)
        if attend is not None:
            block.attn.attend = attend
    ddp = FlatDDP(module, process_group=replica_group, all_reduce=collectives)
    ddp.require_backward_grad_sync = False  # sync_gradients() after the pipeline's step
    stage = PipelineStage(ddp, s, pp, group=pp_group)
    return ddp, stage, torch.optim.AdamW(module.parameters(), lr=lr)


def build_3d(cfg, dp, tp, pp, seed, lr, microbatches, schedule, collectives):
    """(dims, stage module in FlatDDP, its PipelineStage, optimizer, schedule) of this
    rank: see the module's docstring."""
    from course_lib.pipeline import make_schedule

    dims = ParallelDims(dp=dp, tp=tp, pp=pp).build()
    ddp, stage, opt = stage_on_mesh(cfg, dims.coords.pp, pp, seed, lr, dims.group("tp"),
                                    dims.group("dp"), dims.group("pp"), collectives)
    return dims, ddp, stage, opt, make_schedule(schedule, pp, microbatches)


def dp_tp_pp(cfg, dp, inner, seed, lr, microbatches, schedule, collectives, tp=2, **_):
    """The ``"dp_tp_pp"`` strategy of :func:`~course_lib.hybrid.strategies.build`:
    ``inner`` = tp x pp ranks per replica."""
    from course_lib.hybrid.strategies import pipeline_run

    if inner % tp:
        raise ValueError(f"DP x TP x PP: inner = {inner} ranks per replica is not a "
                         f"multiple of tp = {tp}")
    dims, ddp, stage, opt, plan = build_3d(cfg, dp, tp, inner // tp, seed, lr, microbatches,
                                           schedule, collectives)
    # one rank per replica reports the loss: the last stage's first tp rank
    return pipeline_run("dp_tp_pp", dims, ddp, stage, opt, plan, cfg, dp,
                        stage.is_last and dims.coords.tp == 0,
                        lambda: {n: t.cpu() for n, t in tp_dense_state(ddp.module).items()})
