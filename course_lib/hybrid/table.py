"""The strategy table (Lab 06): each strategy measured side by side in one job.

For every strategy of :mod:`~course_lib.hybrid.strategies`, on the same ranks,
the same model and the same batches:

- **tokens/s**: B*T tokens per step over the slowest rank's step time, timed
  untraced and uncounted, bracketed by device synchronisation;
- **model state per rank**: parameters, gradients and AdamW state measured
  (:func:`~course_lib.memory.measure.model_state_bytes_of`) beside the
  estimator's :func:`model_state_estimate`, at the rank that holds most;
- **step peak per rank**: the highest allocation level of one step above the
  parameters and optimizer state (gradients, activations, gathered parameters,
  communication buffers), measured;
- **bytes per step**: what each rank handed to collectives (their payloads)
  and sent point to point, from :func:`course_lib.comm.counting`, at the rank
  that moved most.

Each of those is a separate step, so that counting and memory tracking never
touch the timed ones.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.hybrid.strategies import LABELS, STRATEGIES, build
from course_lib.memory.estimate import piece_params
from course_lib.memory.measure import model_state_bytes_of, peak_bytes
from course_lib.models import GPTConfig, gpt_param_count
from course_lib.pipeline.partition import partition
from course_lib.pipeline.runs import corpus_batches
from course_lib.pipeline.stage import gpt_piece_costs
from course_lib.runtime.backend import current_device
from course_lib.runtime.device import sync

BYTES_PER_PARAM = 16  # fp32 AdamW: parameter 4 + gradient 4 + first and second moments 8


def pipeline_pieces(cfg: GPTConfig):
    """Parameters of the GPT's pieces in pipeline order: the embeddings, each block,
    the head (:func:`~course_lib.memory.estimate.piece_params`)."""
    embed, block, head = piece_params(cfg)
    return [embed] + [block] * cfg.layers + [head]


def params_per_rank(name, cfg: GPTConfig, dp=2, inner=2, tp=2, cp=2, n_experts=4):
    """Parameters held by the rank that holds most, under strategy ``name``.

    - DP: all P.
    - DP x TP: a block's 12D^2 + 4D of matrices and column biases split t ways,
      its 6D of LayerNorms and row biases whole; embeddings and head whole.
    - DP x PP: the largest stage of the partition the strategy uses.
    - DP x FSDP: each unit (a block; the root: embeddings and head) flattened,
      padded to a multiple of n = inner and cut into n shards.
    - DP x TP x PP: the largest stage of the pp = inner / tp partition, its blocks
      split t ways as under DP x TP.
    - DP x CP x TP x PP: as DP x TP x PP with pp = inner / (cp tp): the cp ranks of a
      stage hold the same weights (context parallelism splits activations only).
    - MoE, experts on every rank: the MoE GPT's shared weights and all L E experts
      (:func:`~course_lib.hybrid.experts.moe_params`).
    - MoE, DP x EP: the shared weights and L E / n experts, n = dp x inner."""
    if name in ("moe_dp", "moe_dp_ep"):
        from course_lib.hybrid.experts import moe_params

        shared, experts = moe_params(cfg, n_experts)
        return shared + (experts // (dp * inner) if name == "moe_dp_ep" else experts)
    d, pieces = cfg.dim, pipeline_pieces(cfg)
    if name == "dp":
        return gpt_param_count(cfg)
    if name == "dp_tp":
        block = (12 * d * d + 4 * d) // inner + 6 * d
        return pieces[0] + cfg.layers * block + pieces[-1]
    if name in ("dp_pp", "dp_tp_pp", "dp_cp_tp_pp"):
        t = tp if name != "dp_pp" else 1
        c = cp if name == "dp_cp_tp_pp" else 1
        split = [pieces[0]] + [(12 * d * d + 4 * d) // t + 6 * d] * cfg.layers + [pieces[-1]]
        ranges = partition(gpt_piece_costs(cfg), inner // (t * c))
        return max(sum(split[i] for i in r) for r in ranges)
    if name == "dp_fsdp":
        units = [pieces[0] + pieces[-1]] + pieces[1:-1]
        return sum(max(math.ceil(u / inner), 1) for u in units)
    raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(LABELS)}")


def model_state_estimate(name, cfg: GPTConfig, dp=2, inner=2, tp=2, cp=2, n_experts=4):
    """Bytes of parameters, gradients and AdamW state on the fullest rank (fp32)."""
    return BYTES_PER_PARAM * params_per_rank(name, cfg, dp, inner, tp, cp, n_experts)


def _max(value):
    t = torch.tensor([float(value)], device=current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure_strategy(name, cfg: GPTConfig, batch=8, steps=3, dp=2, inner=2, **kw):
    """On every rank: build strategy ``name``, then one warm-up step, one counted,
    one under the memory tracker and ``steps`` timed. Returns its row (the same
    on every rank)."""
    device = current_device()
    run = build(name, cfg, dp, inner, **kw)
    try:
        data = list(corpus_batches(cfg, batch, steps + 3, device))
        run.step(*data[0])
        with comm.counting() as stats:
            run.step(*data[1])
        # from a level without gradients (as after zero_grad): what the tracker sees
        # freed must have been allocated while it watched
        run.optimizer.zero_grad(set_to_none=True)
        with peak_bytes(device) as peak:
            run.step(*data[2])
        state = model_state_bytes_of(run.model, run.optimizer)["total"]
        dist.barrier()
        sync()
        start = time.perf_counter()
        for x, y in data[3:]:
            run.step(x, y)
        sync()
        seconds = _max(time.perf_counter() - start) / steps
        collective_bytes = sum(stats.collective_bytes.values())
        return {"strategy": LABELS[name], "tokens_per_s": batch * cfg.seq_len / seconds,
                "step_ms": 1e3 * seconds,
                "state_mb": _max(state) / 1e6,
                "state_estimate_mb": model_state_estimate(
                    name, cfg, dp, inner, kw.get("tp", 2), kw.get("cp", 2),
                    kw.get("n_experts", 4)) / 1e6,
                "step_peak_mb": _max(peak.peak) / 1e6,
                "collective_mb": _max(collective_bytes) / 1e6,
                "p2p_mb": _max(stats.sent_bytes) / 1e6}
    finally:
        run.destroy()


def strategy_table(cfg: GPTConfig, batch=8, steps=3, names=tuple(STRATEGIES), **kw):
    """Rows of :func:`measure_strategy` for each strategy, in one job."""
    return [measure_strategy(name, cfg, batch, steps, **kw) for name in names]


def format_table(rows):
    """The rows as a markdown table."""
    head = ("| strategy | tokens/s | step (ms) | model state / rank (MB), measured | estimated "
            "| step peak above weights + optimizer (MB) | collectives (MB/step) | p2p sent (MB/step) |\n"
            "|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['strategy']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {r['state_mb']:.3f} "
        f"| {r['state_estimate_mb']:.3f} | {r['step_peak_mb']:.2f} "
        f"| {r['collective_mb']:.3f} | {r['p2p_mb']:.3f} |\n" for r in rows)
