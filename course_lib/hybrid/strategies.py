"""The course GPT on a 2-D mesh: DP x TP, DP x PP and DP x FSDP (Lab 06).

Each strategy is data parallelism over ``dp`` replicas combined with one way of
splitting a replica over ``inner`` ranks, on ``dp * inner`` ranks laid out as
:class:`~course_lib.mesh.ParallelDims` lays them out (the inner dim fastest):

- ``"dp"``: the baseline, a whole replica on every one of the ``dp * inner``
  ranks in Lab 02's bucketed :class:`~course_lib.ddp.DDP`.
- ``"dp_tp"``: every block tensor parallel over the tp group (Lab 05's
  ``parallelize_block``: attention by heads, the MLP column then row), the
  embeddings and the head replicated; the whole replica in Lab 02's bucketed
  :class:`~course_lib.ddp.DDP` over the dp group.
- ``"dp_pp"``: the model cut into ``inner`` pipeline stages (Lab 04's
  partition of the GPT's pieces), run with 1F1B over ``microbatches``; each
  stage in :class:`~course_lib.ddp.FlatDDP` over the dp group, which averages
  the gradients once the stage's last backward is done (a pipeline's
  backwards come in an order no forward announces, so DDP cannot decide at
  forward which one synchronises).
- ``"dp_fsdp"``: Lab 03's :class:`~course_lib.fsdp.FSDP` with HYBRID_SHARD,
  a unit per block, sharded over the inner dim and replicated over dp. Every
  one of the ``dp * inner`` ranks is a data-parallel rank here: the shard group
  splits memory, not the batch.

A step on a batch of B sequences gives each of the R data-parallel replicas
(R = dp, or dp * inner for FSDP) B/R rows. Each replica's loss is the mean over
its rows, and the averaged gradients are those of the mean over all B rows:
the same update a single process makes on the whole batch, which
:func:`reference_training` makes.

    out = run(train_strategy, "dp_tp", cfg, steps=4, batch=8, nproc=4)
    ref = reference_training(cfg, steps=4, batch=8)
    out[0]["losses"], ref["losses"]       # equal to 1e-5 in fp32
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.hybrid.four_d import dp_cp_tp_pp
from course_lib.hybrid.three_d import dp_tp_pp
from course_lib.mesh import ParallelDims
from course_lib.models import GPT, Block, GPTConfig
from course_lib.pipeline.runs import corpus_batches, gpt_loss
from course_lib.runtime.backend import current_device

STRATEGIES = {"dp": "DP", "dp_tp": "DP x TP", "dp_pp": "DP x PP", "dp_fsdp": "DP x FSDP"}
# the 2-D strategies above run on dp * inner ranks; DP x TP x PP splits inner = tp * pp
# (course_lib.hybrid.three_d), DP x CP x TP x PP inner = cp * tp * pp (.four_d)
LABELS = {**STRATEGIES, "dp_tp_pp": "DP x TP x PP", "dp_cp_tp_pp": "DP x CP x TP x PP",
          # another model, a mixture of experts (course_lib.hybrid.experts), on dp * inner ranks
          "moe_dp": "DP (MoE, experts on every rank)", "moe_dp_ep": "DP x EP (MoE, ep = dp)"}
LR = 3e-3


@dataclass
class Strategy:
    """What one rank built: ``step(x, y)`` trains on the global batch (each rank
    takes its rows) and returns the batch's mean loss on every rank."""
    name: str
    dims: ParallelDims
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable | None  # set once the Strategy exists (it needs run.rows)
    full_state: Callable  # () -> {name: full tensor}, on every rank
    replica: tuple[int, int]  # (index, count) of this rank's data-parallel replica
    extra: dict = field(default_factory=dict)

    def rows(self, batch):
        """This rank's rows of a global batch."""
        index, count = self.replica
        if batch.shape[0] % count:
            raise ValueError(f"{LABELS[self.name]}: a batch of {batch.shape[0]} rows does "
                             f"not split evenly over {count} data-parallel replicas")
        size = batch.shape[0] // count
        return batch[index * size:(index + 1) * size]

    def destroy(self):
        """Free the sub-groups and meshes (every rank), so the job can build another."""
        for mesh in self.extra.get("meshes", []):
            for pg in {id(g): g for g in mesh.get_all_groups()}.values():
                if pg is not dist.group.WORLD:
                    dist.destroy_process_group(pg)
        self.dims.destroy()


def mean_over_replicas(loss, holds_loss, replicas):
    """The global batch's mean loss on every rank: the replicas' means averaged.
    ``holds_loss``: this rank reports its replica (one rank per replica)."""
    value = loss.detach().float() / replicas if holds_loss else torch.zeros(())
    value = value.to(current_device()).reshape(1)
    dist.all_reduce(value)
    return value.item()


def _whole_model_step(run, model, loss_fn, holds_loss):
    """``run.step`` for a model that takes its replica's rows in one forward (every
    strategy but the pipeline, whose stages share theirs out in microbatches)."""
    def step(x, y):
        run.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(run.rows(x)), run.rows(y))
        loss.backward()
        run.optimizer.step()
        return mean_over_replicas(loss, holds_loss, run.replica[1])

    run.step = step
    return run


def build(name, cfg: GPTConfig, dp=2, inner=2, seed=0, lr=LR, microbatches=2,
          schedule="1f1b", collectives="torch", tp=2, cp=2, **moe):
    """Build strategy ``name`` (a key of :data:`LABELS`) on every rank of a
    ``dp * inner``-rank job, from ``GPT(cfg, seed)``'s weights, with AdamW
    (``tp``: DP x TP x PP's tensor-parallel degree, inner = tp x pp; ``cp``: DP x CP x
    TP x PP's context-parallel degree, inner = cp x tp x pp; ``moe``: the MoE rows'
    n_experts, top_k, capacity_factor)."""
    if name in ("moe_dp", "moe_dp_ep"):
        from course_lib.hybrid.experts import moe_strategy

        return moe_strategy(name, cfg, dp, inner, seed, lr, **moe)
    builders = {"dp": _dp, "dp_tp": _dp_tp, "dp_pp": _dp_pp, "dp_fsdp": _dp_fsdp,
                "dp_tp_pp": dp_tp_pp, "dp_cp_tp_pp": dp_cp_tp_pp}
    if name not in builders:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(LABELS)}")
    return builders[name](cfg, dp, inner, seed, lr, microbatches=microbatches,
                          schedule=schedule, collectives=collectives, tp=tp, cp=cp)


def _dp(cfg, dp, inner, seed, lr, collectives, **_):
    from course_lib.ddp import DDP

    dims = ParallelDims(dp=dp * inner).build()  # the baseline: a whole replica per rank
    model = GPT(cfg, seed).to(current_device())
    ddp = DDP(model, process_group=dims.group("dp"), all_reduce=collectives)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def full_state():
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    run = Strategy("dp", dims, ddp, opt, None, full_state, (dims.coords.dp, dp * inner))
    return _whole_model_step(run, ddp, gpt_loss(cfg.vocab), holds_loss=True)


def _dp_tp(cfg, dp, inner, seed, lr, collectives, **_):
    from course_lib.ddp import DDP
    from course_lib.hybrid.three_d import tp_dense_state
    from course_lib.tp import parallelize_block

    dims = ParallelDims(dp=dp, tp=inner).build()
    model = GPT(cfg, seed).to(current_device())
    for block in model.blocks:
        parallelize_block(block, dims.group("tp"), collectives=collectives)
    ddp = DDP(model, process_group=dims.group("dp"), all_reduce=collectives)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def full_state():
        return tp_dense_state(model)

    run = Strategy("dp_tp", dims, ddp, opt, None, full_state, (dims.coords.dp, dp))
    # the tp ranks of a replica hold the same loss: one of them reports it
    return _whole_model_step(run, ddp, gpt_loss(cfg.vocab), holds_loss=dims.coords.tp == 0)


def _dp_pp(cfg, dp, inner, seed, lr, microbatches, schedule, collectives, **_):
    from course_lib.ddp import FlatDDP
    from course_lib.pipeline import PipelineStage, make_schedule
    from course_lib.pipeline.stage import gpt_stage

    dims = ParallelDims(dp=dp, pp=inner).build()
    s = dims.coords.pp
    module = gpt_stage(cfg, s, inner, seed).to(current_device())
    ddp = FlatDDP(module, process_group=dims.group("dp"), all_reduce=collectives)
    ddp.require_backward_grad_sync = False  # sync_gradients() after the step instead
    stage = PipelineStage(ddp, s, inner, group=dims.group("pp"))
    plan = make_schedule(schedule, inner, microbatches)
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    return pipeline_run("dp_pp", dims, ddp, stage, opt, plan, cfg, dp, stage.is_last,
                        lambda: {n: p.detach().cpu().clone()
                                 for n, p in module.named_parameters()})


def pipeline_run(name, dims, ddp, stage, opt, plan, cfg, dp, holds_loss, stage_state):
    """The Strategy of a pipelined replica (DP x PP, DP x TP x PP): a step runs the
    schedule on its rows, averages the stage's gradients over dp, then steps;
    ``stage_state()`` is this stage's part of the full state, gathered over pp."""
    from course_lib.pipeline import pipeline_step

    loss_fn = gpt_loss(cfg.vocab)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = pipeline_step(stage, plan, batch=run.rows(x) if stage.is_first else None,
                             targets=run.rows(y) if stage.is_last else None,
                             loss_fn=loss_fn if stage.is_last else None)
        ddp.sync_gradients()
        opt.step()
        return mean_over_replicas(loss, holds_loss, dp)

    def full_state():
        stages = [None] * stage.n_stages
        dist.all_gather_object(stages, stage_state(), group=dims.group("pp"))
        return {n: t for part in stages for n, t in part.items()}

    run = Strategy(name, dims, ddp, opt, step, full_state, (dims.coords.dp, dp),
                   extra={"stage": stage, "schedule": plan})
    return run


def _dp_fsdp(cfg, dp, inner, seed, lr, collectives, **_):
    from course_lib.fsdp import FSDP, by_type
    from course_lib.runtime.backend import device_mesh

    # the replica/shard mesh is the (dp, tp) grid with the inner dim renamed
    dims = ParallelDims(dp=dp, tp=inner).build()
    mesh = device_mesh((dp, inner), ("replicate", "shard"))
    model = FSDP(GPT(cfg, seed).to(current_device()), units=by_type(Block), sharding="hybrid",
                 mesh=mesh, collectives=collectives)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    run = Strategy("dp_fsdp", dims, model, opt, None, model.full_state_dict,
                   (dist.get_rank(), dp * inner), extra={"meshes": [mesh]})
    return _whole_model_step(run, model, gpt_loss(cfg.vocab), holds_loss=True)


def train_strategy(name, cfg: GPTConfig, steps=4, batch=8, dp=2, inner=2, seed=0, lr=LR,
                   **kw):
    """On every rank: train strategy ``name`` for ``steps`` steps on the course
    corpus. Returns {"losses", "coords", "state"}; "state" (the full parameters
    after training) on global rank 0 only, None elsewhere."""
    run = build(name, cfg, dp, inner, seed, lr, **kw)
    try:
        losses = [run.step(x, y) for x, y in corpus_batches(cfg, batch, steps, current_device())]
        state = {n: t.cpu() for n, t in run.full_state().items()}
        return {"losses": losses, "coords": tuple(run.dims.coords),
                "state": state if dist.get_rank() == 0 else None}
    finally:
        run.destroy()


def reference_training(cfg: GPTConfig, steps=4, batch=8, seed=0, lr=LR):
    """One process, the whole model, the whole batch: {"losses", "state"}."""
    model = GPT(cfg, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn, losses = gpt_loss(cfg.vocab), []
    for x, y in corpus_batches(cfg, batch, steps, "cpu"):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {n: p.detach().clone() for n, p in model.named_parameters()}}


def max_difference(state, reference):
    """The largest absolute difference between two state dicts with the same names."""
    if state.keys() != reference.keys():
        missing, extra = reference.keys() - state.keys(), state.keys() - reference.keys()
        raise ValueError(f"the state dicts differ in names: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(extra)[:3]}")
    return max((state[n].float() - reference[n].float()).abs().max().item() for n in reference)
