"""Jobs that Lab 04 and the benchmark run on every rank of a pipeline, one stage per rank.

Each takes the schedule by name and, optionally, the student's
``forward_step``/``backward_step`` (None: the library's), so a notebook cell is
one ``run(...)`` call::

    result = run(traced_fixed, 8, "1f1b", 0.01, 0.02, nproc=4)
    measured_bubble(result.trace)

Every job works unchanged on gloo (CPU ranks) and NCCL (one GPU per rank).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import trace
from course_lib.data import char_corpus
from course_lib.models import GPTConfig
from course_lib.pipeline.executor import pipeline_step
from course_lib.pipeline.measure import FixedTimeStage
from course_lib.pipeline.schedules import make_schedule
from course_lib.pipeline.stage import GPTStage, PipelineStage, gpt_pieces, gpt_stage
from course_lib.runtime.backend import current_device
from course_lib.runtime.device import sync


def _rank():
    return dist.get_rank(), dist.get_world_size()


def _steps(kw):
    return {k: kw[k] for k in ("forward_step", "backward_step") if kw.get(k) is not None}


def _args(stage, x, y, loss_fn):
    return dict(batch=x if stage.is_first else None, targets=y if stage.is_last else None,
                loss_fn=loss_fn)


def gpt_loss(vocab):
    return lambda logits, y: F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))


def corpus_batches(cfg: GPTConfig, batch, steps, device):
    """``steps`` (x, y) batches of ``batch`` windows of the course corpus, the same on
    every rank (stage 0 uses x, the last stage y)."""
    inputs, targets, _ = char_corpus(cfg.seq_len)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        # a CPU generator draws on the CPU, whatever the rank's default device
        idx = torch.randint(0, len(inputs), (batch,), generator=gen, device="cpu")
        yield inputs[idx].to(device), targets[idx].to(device)


def corpus_config(layers=4, dim=64, heads=4, seq_len=32):
    """A GPT shape for the corpus: its vocabulary is the corpus's characters."""
    _, _, chars = char_corpus(seq_len)
    return GPTConfig(vocab=len(chars), dim=dim, layers=layers, heads=heads, seq_len=seq_len)


@trace.paused()  # untimed: spare the trace's per-message thread hand-offs
def train_gpt(cfg, schedule_kind, m, steps=3, batch=16, lr=3e-3, **kw):
    """Train the GPT on the corpus for ``steps`` steps; the last stage returns its losses."""
    s, p = _rank()
    device = current_device()
    stage = PipelineStage(gpt_stage(cfg, s, p).to(device), s, p)
    opt = torch.optim.AdamW(stage.module.parameters(), lr=lr)
    schedule, losses = make_schedule(schedule_kind, p, m), []
    for x, y in corpus_batches(cfg, batch, steps, device):
        opt.zero_grad()
        loss = pipeline_step(stage, schedule, **_args(stage, x, y, gpt_loss(cfg.vocab)),
                             **_steps(kw))
        opt.step()
        if loss is not None:
            losses.append(loss.item())
    return losses if stage.is_last else None


def traced_gpt(cfg, schedule_kind, m, batch=16, **kw):
    """One traced step of the GPT (after an untraced one); returns the stage's pieces."""
    s, p = _rank()
    device = current_device()
    stage = PipelineStage(gpt_stage(cfg, s, p).to(device), s, p)
    x, y = next(corpus_batches(cfg, batch, 1, device))
    schedule = make_schedule(schedule_kind, p, m)
    with trace.paused():
        pipeline_step(stage, schedule, **_args(stage, x, y, gpt_loss(cfg.vocab)), **_steps(kw))
    dist.barrier()
    pipeline_step(stage, schedule, **_args(stage, x, y, gpt_loss(cfg.vocab)), **_steps(kw))
    pieces = gpt_pieces(cfg)
    return [pieces[i] for i in stage.module.pieces]


def traced_fixed(m, schedule_kind, t_f=0.01, t_b=0.02, trace_messages=True, **kw):
    """One traced step of :class:`FixedTimeStage` stages (after an untraced one).
    ``trace_messages=False`` records the actions only: what a bubble measurement
    wants, since on gloo each message's span costs a thread hand-off."""
    s, p = _rank()
    device = current_device()
    x = torch.ones(2 * m, 4, device=device)
    stage = PipelineStage(FixedTimeStage(t_f, t_b).to(device), s, p,
                          trace_messages=trace_messages)
    schedule = make_schedule(schedule_kind, p, m)
    with trace.paused():
        pipeline_step(stage, schedule, **_args(stage, x, x, F.mse_loss), **_steps(kw))
    dist.barrier()
    pipeline_step(stage, schedule, **_args(stage, x, x, F.mse_loss), **_steps(kw))


@trace.paused()
def activation_memory(cfg, schedule_kind, m, batch=16, **kw):
    """(most microbatches in flight, their bytes saved by autograd) on this stage of the
    GPT for one step, and the bytes of one microbatch (from a one-microbatch step)."""
    s, p = _rank()
    device = current_device()
    stage = PipelineStage(gpt_stage(cfg, s, p).to(device), s, p, measure_activations=True)
    x, y = next(corpus_batches(cfg, batch, 1, device))
    pipeline_step(stage, make_schedule(schedule_kind, p, m),
                  **_args(stage, x, y, gpt_loss(cfg.vocab)), **_steps(kw))
    held = (stage.peak_in_flight, stage.peak_activation_bytes)
    one = x[: batch // m] if stage.is_first else None
    pipeline_step(stage, make_schedule("gpipe", p, 1),
                  **_args(stage, one, y[: batch // m], gpt_loss(cfg.vocab)), **_steps(kw))
    return (*held, stage.peak_activation_bytes)


def profile_pieces(cfg, batch=16, repeats=5):
    """Seconds of forward + backward of each of the GPT's pieces (:func:`gpt_pieces`) on
    this process, inputs of the shapes they get in the model: the profile PipeDream's
    partitioner starts from. Every piece is warmed up first, and each time is the
    fastest of ``repeats`` (other processes only ever add time). Runs where it is
    called (no ranks needed)."""
    device = current_device()
    x, _ = next(corpus_batches(cfg, batch, 1, device))
    pieces, inputs = [], []
    for i in range(cfg.layers + 2):
        pieces.append(GPTStage(cfg, range(i, i + 1)).to(device))
        inputs.append(x if i == 0 else torch.randn(batch, cfg.seq_len, cfg.dim, device=device,
                                                   requires_grad=True))
        pieces[-1](inputs[-1]).sum().backward()
    best = [float("inf")] * len(pieces)
    for _ in range(repeats):
        for i, (piece, inp) in enumerate(zip(pieces, inputs)):
            sync(device)
            start = time.perf_counter()
            piece(inp).sum().backward()
            sync(device)
            best[i] = min(best[i], time.perf_counter() - start)
    return best
