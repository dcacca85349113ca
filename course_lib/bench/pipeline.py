"""Pipeline schedules, ours and torch.distributed.pipelining's, side by side (Lab 04).

One job of p ranks, one stage per rank. Two measurements:

- **step time** on real stages (an MLP, ``depth`` Linear+ReLU layers of ``width``
  per stage, so stages are balanced): naive model parallelism (m = 1), GPipe and
  1F1B, ours (``pipeline_step``) and torch's (``ScheduleGPipe``,
  ``Schedule1F1B``) on copies of the same stage modules, alternating in rounds.
  A step is zero_grad, the schedule, SGD step; the time is the slowest rank's
  mean per step, median over rounds. The bubble beside it comes from one more,
  instrumented step of each: every stage stamps the start and end of each
  forward and backward it computes (identity autograd functions at the stage's
  input and output, installed by forward hooks, so ours and torch's are timed
  alike), and bubble = 1 - mean busy / step time.
- **bubble** on :class:`~course_lib.pipeline.FixedTimeStage` stages (t_f, t_b of
  sleep, which leaves the CPU to the other ranks): ours measured from a traced
  step's action spans, and both ours and torch's from the step time,
  1 - m(t_f + t_b) / step, held against (p-1)/(m+p-1) for m in p, 2p, 4p.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib import trace
from course_lib.pipeline import (FixedTimeStage, PipelineStage, bubble_fraction, make_schedule,
                                 measured_bubble, pipeline_step)
from course_lib.pipeline.runs import traced_fixed
from course_lib.runtime.backend import current_device
from course_lib.runtime.device import sync

VARIANTS = ("naive", "gpipe", "1f1b")


def stage_module(width, depth, seed):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).to(current_device())


class _Runner:
    """One training step of one variant on this rank, ours or torch's."""

    def __init__(self, impl, variant, module, m, x, y):
        s, p = dist.get_rank(), dist.get_world_size()
        self.s, self.p, self.x, self.y = s, p, x, y
        self.module = module
        self.m = 1 if variant == "naive" else m
        self.opt = torch.optim.SGD(module.parameters(), lr=1e-3)
        if impl == "ours":
            self.stage = PipelineStage(module, s, p)
            self.schedule = make_schedule(variant, p, self.m)
            self.run = self._ours
        else:
            from torch.distributed.pipelining import PipelineStage as TorchStage
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

            stage = TorchStage(module, s, p, current_device())
            kind = Schedule1F1B if variant == "1f1b" else ScheduleGPipe
            self.schedule = kind(stage, n_microbatches=self.m, loss_fn=F.mse_loss)
            self.run = self._torch

    def _ours(self):
        pipeline_step(self.stage, self.schedule, batch=self.x if self.s == 0 else None,
                      targets=self.y if self.s == self.p - 1 else None, loss_fn=F.mse_loss)

    def _torch(self):
        # one stage is first and last at once: it takes the inputs and the targets
        inputs = (self.x,) if self.s == 0 else ()
        last = dict(target=self.y, losses=[]) if self.s == self.p - 1 else {}
        self.schedule.step(*inputs, **last)

    def step(self):
        self.opt.zero_grad()
        self.run()
        self.opt.step()


def _timed(fn, steps, device):
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64,
                           device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


class _Stamp(torch.autograd.Function):
    """Identity on ``x``; when the backward pass reaches it, appends the time to
    ``log``. ``anchor`` (requires grad) keeps it in the graph when ``x`` does not."""

    @staticmethod
    def forward(ctx, x, anchor, log, device):
        ctx.log, ctx.device, ctx.x_grad = log, device, x.requires_grad
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        sync(ctx.device)
        ctx.log.append(time.perf_counter())
        return (grad if ctx.x_grad else None), None, None, None


class _BusyClock:
    """Seconds this stage's module spends in forward and backward, measured inside a
    real pipelined step (on a GPU, synchronising at each stamp)."""

    def __init__(self, module, device):
        self.device, self.forward_s = device, 0.0
        self.backward_starts, self.backward_ends = [], []
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self.hooks = [module.register_forward_pre_hook(self._pre),
                      module.register_forward_hook(self._post)]

    def _pre(self, module, args):
        sync(self.device)
        self._t0 = time.perf_counter()
        return (_Stamp.apply(args[0], self.anchor, self.backward_ends, self.device), *args[1:])

    def _post(self, module, args, output):
        sync(self.device)
        self.forward_s += time.perf_counter() - self._t0
        return _Stamp.apply(output, self.anchor, self.backward_starts, self.device)

    def busy_s(self):
        backward = sum(e - b for b, e in zip(self.backward_starts, self.backward_ends))
        return self.forward_s + backward

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def _instrumented_step(runner, device):
    """(step seconds, busy seconds on this rank) of one step with stamps."""
    clock = _BusyClock(runner.module, device)
    try:
        step = _timed(runner.step, 1, device)
    finally:
        clock.remove()
    return step, clock.busy_s()


@trace.paused()  # spans cost time (a thread hand-off per gloo message); timelines are traced apart
def measure_real(width=1024, depth=2, batch=128, m=None, steps=3, rounds=3):
    """{variant: {"ours_s", "torch_s", "ours_bubble", "torch_bubble"}} on real MLP stages."""
    s, p, device = dist.get_rank(), dist.get_world_size(), current_device()
    m = m or 2 * p
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=gen, device="cpu").to(device)
    y = torch.randn(batch, width, generator=gen, device="cpu").to(device)
    base = stage_module(width, depth, seed=s)
    runners = {(impl, v): _Runner(impl, v, copy.deepcopy(base), m, x, y)
               for v in VARIANTS for impl in ("ours", "torch")}
    for runner in runners.values():
        runner.step()  # warm-up (torch infers shapes on its first step)
    samples = {key: [] for key in runners}
    for _ in range(rounds):
        for key, runner in runners.items():
            samples[key].append(_timed(runner.step, steps, device))
    instrumented = {key: _instrumented_step(runner, device) for key, runner in runners.items()}
    busy = torch.tensor([instrumented[key][1] for key in runners], dtype=torch.float64,
                        device=device)
    dist.all_reduce(busy)  # summed over stages
    mean_busy = dict(zip(runners, (busy / p).tolist()))
    out = {}
    for v in VARIANTS:
        row = {}
        for impl in ("ours", "torch"):
            row[f"{impl}_s"] = statistics.median(samples[(impl, v)])
            row[f"{impl}_bubble"] = 1 - mean_busy[(impl, v)] / instrumented[(impl, v)][0]
        out[v] = row
    return {"m": m, "width": width, "depth": depth, "batch": batch, "variants": out}


@trace.paused()
def measure_fixed(ms, variant, t_f=0.01, t_b=0.02, steps=2):
    """For each m: {"torch_s", "ours_s"} per step of FixedTimeStage stages."""
    device = current_device()
    out = {}
    for m in ms:
        x = torch.ones(2 * m, 4, device=device)
        row = {}
        for impl in ("ours", "torch"):
            runner = _Runner(impl, variant, FixedTimeStage(t_f, t_b).to(device), m, x, x)
            runner.step()
            row[f"{impl}_s"] = _timed(runner.step, steps, device)
        out[m] = row
    return out


def bubble_table(nproc, backend="auto", t_f=0.01, t_b=0.02, timeout=900):
    """Run the fixed-time measurements from the notebook side (several jobs' calls)."""
    from course_lib.runtime.launcher import run

    ms = [nproc, 2 * nproc, 4 * nproc]
    rows = []
    for variant in ("gpipe", "1f1b"):
        timed = run(measure_fixed, ms, variant, t_f, t_b, nproc=nproc, backend=backend,
                    timeout=timeout)[0]
        for m in ms:
            traced = run(traced_fixed, m, variant, t_f, t_b, trace_messages=False, nproc=nproc,
                         backend=backend, timeout=timeout)
            work = m * (t_f + t_b)
            rows.append({"variant": variant, "m": m, "theory": bubble_fraction(nproc, m),
                         "ours_trace": measured_bubble(traced.trace),
                         "ours_time": 1 - work / timed[m]["ours_s"],
                         "torch_time": 1 - work / timed[m]["torch_s"],
                         "ours_s": timed[m]["ours_s"], "torch_s": timed[m]["torch_s"]})
    return rows


def format_real(result, nproc):
    lines = [f"Real stages on {nproc} ranks: MLP {result['depth']} x Linear({result['width']}) "
             f"per stage, batch {result['batch']}, m={result['m']} (naive: m=1)",
             f"{'schedule':>9} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>11} "
             f"{'bubble ours':>12} {'bubble torch':>13} {'theory':>7}"]
    for v, r in result["variants"].items():
        m = 1 if v == "naive" else result["m"]
        lines.append(f"{v:>9} {r['ours_s'] * 1e3:>9.1f} {r['torch_s'] * 1e3:>9.1f} "
                     f"{r['ours_s'] / r['torch_s']:>11.2f} {r['ours_bubble']:>12.3f} "
                     f"{r['torch_bubble']:>13.3f} {bubble_fraction(nproc, m):>7.3f}")
    return "\n".join(lines)


def format_bubbles(rows, nproc, t_f, t_b):
    lines = [f"Fixed-time stages on {nproc} ranks (t_f={t_f * 1e3:g} ms, t_b={t_b * 1e3:g} ms): "
             f"bubble measured vs (p-1)/(m+p-1)",
             f"{'schedule':>9} {'m':>3} {'theory':>7} {'ours (trace)':>13} {'ours (time)':>12} "
             f"{'torch (time)':>13} {'ours/torch':>11}"]
    for r in rows:
        lines.append(f"{r['variant']:>9} {r['m']:>3} {r['theory']:>7.3f} {r['ours_trace']:>13.3f} "
                     f"{r['ours_time']:>12.3f} {r['torch_time']:>13.3f} "
                     f"{r['ours_s'] / r['torch_s']:>11.2f}")
    return "\n".join(lines)
