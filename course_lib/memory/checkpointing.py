"""Activation checkpointing, measured: the memory it saves and the recompute it costs (Lab 03).

Autograd keeps, from forward to backward, every intermediate tensor a
backward formula needs: per block about 5BTD + B N_h T^2 values in the
lecture's accounting. Checkpointing a block keeps only its input (BTD) and
runs its forward a second time inside backward to rebuild the rest, one
block at a time: activation memory falls from ~N x (block) to ~N x BTD +
one block, and a step pays one extra forward of every block (~1/3 more
compute, backward being ~2 forwards).

    report = compare_checkpointing(GPTConfig(...), batch=8)
    report["on"]["kept_bytes"] / report["off"]["kept_bytes"]    # e.g. 0.3
    report["on"]["step_s"] / report["off"]["step_s"]            # e.g. 1.3
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from course_lib.memory.measure import peak_bytes


class Checkpointed(nn.Module):
    """``module`` whose forward activations are recomputed in backward, not kept."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.module(*args)
        # use_reentrant=False: the variant torch recommends; it works with
        # inputs that do not require grad and with keyword arguments
        return checkpoint(self.module, *args, use_reentrant=False)


def checkpoint_blocks(model):
    """Wrap every block of the course GPT (``model.blocks``) in place; returns model."""
    for i, block in enumerate(model.blocks):
        if not isinstance(block, Checkpointed):
            model.blocks[i] = Checkpointed(block)
    return model


def measure_step(model, tokens, targets, rounds=3):
    """{"kept_bytes": bytes still allocated after forward (what autograd keeps for
    backward, the loss included), "peak_bytes": the peak of forward + backward,
    "step_s": median seconds of forward + backward}."""
    model.zero_grad(set_to_none=True)
    model.loss(tokens, targets).backward()  # warm-up: first-call allocations
    model.zero_grad(set_to_none=True)
    with peak_bytes() as fwd:  # the profiler behind peak_bytes does not nest: two passes
        loss = model.loss(tokens, targets)
    loss.backward()
    model.zero_grad(set_to_none=True)
    with peak_bytes() as whole:
        model.loss(tokens, targets).backward()
    times = []
    for _ in range(rounds):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model.loss(tokens, targets).backward()
        times.append(time.perf_counter() - start)
    return {"kept_bytes": fwd.end, "peak_bytes": whole.peak, "step_s": statistics.median(times)}


def compare_checkpointing(cfg, batch, rounds=3, seed=0):
    """The same GPT and batch without and with every block checkpointed, on
    this process's CPU: {"off": measure_step(...), "on": measure_step(...)}."""
    from course_lib.models import GPT

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen, device="cpu")
    targets = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen, device="cpu")
    out = {}
    for name, wrap in (("off", lambda m: m), ("on", checkpoint_blocks)):
        out[name] = measure_step(wrap(GPT(cfg, seed=seed)), tokens, targets, rounds)
    return out
