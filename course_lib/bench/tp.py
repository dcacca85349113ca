"""One transformer block, tensor parallel three ways, side by side in one job (Lab 05).

- **ours**: :func:`course_lib.tp.parallelize_block` (f and g as autograd Functions);
- **torch**: DTensor's ``parallelize_module`` with ``ColwiseParallel`` on the q/k/v
  and MLP-up projections and ``RowwiseParallel`` on the output and MLP-down ones;
- **dense**: the whole block on every rank, t = 1 (each rank computes alone, so
  the machine is as busy as in the other two).

A step is forward and backward of the block for a fixed upstream gradient, the
input requiring grad (as a block inside a network does). Each variant's time is
the slowest rank's mean per step, median over rounds that alternate the
variants. Before timing, the three outputs and input gradients are compared.

torch's ColwiseParallel takes contiguous rows of a weight. For the fused q/k/v
projection that would give rank 0 all of q and part of k, so torch's copy of
the block stores the fused rows permuted to [q_1 k_1 v_1 | q_2 k_2 v_2 | ...]
(rank r's heads contiguous) and counts its heads from the local width: the
same matmuls as ours, in DTensor's hands.

Lab 05 also runs from here: :func:`accounting` (our block against the dense
one, collectives counted each way), :func:`traced_step` (one step for the
timeline) and :func:`traffic` (bytes sent with and without sequence parallelism).
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
from course_lib.models import Block, GPTConfig, init_deterministic
from course_lib.runtime.backend import current_device, device_mesh
from course_lib.runtime.device import sync
from course_lib.tp import parallelize_block

VARIANTS = ("ours", "torch", "dense")


def config(dim=256, heads=8, seq_len=128):
    return GPTConfig(vocab=2, dim=dim, layers=1, heads=heads, seq_len=seq_len)


class _LocalHeadsAttention(nn.Module):
    """Causal self-attention that counts its heads from the width it is given
    (torch's tensor parallelism hands it a local shard of q, k and v)."""

    def __init__(self, attn, t):
        super().__init__()
        dim = attn.qkv.in_features
        self.head_dim = dim // attn.heads
        self.qkv = copy.deepcopy(attn.qkv)
        self.proj = copy.deepcopy(attn.proj)
        with torch.no_grad():  # rank r's heads of q, k and v made contiguous
            parts = attn.qkv.weight.reshape(3, t, dim // t, dim)
            self.qkv.weight.copy_(parts.transpose(0, 1).reshape(3 * dim, dim))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, s, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


def torch_tp_block(dense, group=None):
    """A copy of ``dense`` (a course Block) under DTensor tensor parallelism."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    group = group or dist.group.WORLD
    block = copy.deepcopy(dense)
    block.attn = _LocalHeadsAttention(dense.attn, dist.get_world_size(group))
    mesh = device_mesh(group=group)
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    return parallelize_module(block, mesh, plan)


def build(cfg, seed=0):
    """{variant: module} for this rank, all from the same dense block."""
    device = current_device()
    dense = init_deterministic(Block(cfg), seed, prefix="blocks.0.").to(device)
    return {"ours": parallelize_block(copy.deepcopy(dense)), "torch": torch_tp_block(dense),
            "dense": dense}


def _inputs(cfg, batch, device):
    # the same on every rank (TP replicates X); drawn on the CPU, where the generator is
    gen = torch.Generator().manual_seed(0)
    shape = (batch, cfg.seq_len, cfg.dim)
    x = torch.randn(shape, generator=gen, device="cpu").to(device)
    return x, torch.randn(shape, generator=gen, device="cpu").to(device)


def _step(block, x, upstream):
    x = x.detach().requires_grad_()
    y = block(x)
    y.backward(upstream)
    return y, x.grad


def _timed(block, x, upstream, steps, device):
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        _step(block, x, upstream)
    sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64,
                           device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _torch_comm_counts(block, x, upstream):
    """torch's own count of the collectives DTensor ran in one step."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        _step(block, x, upstream)
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


@trace.paused()  # spans cost time; the timeline has its own traced step
def measure(cfg=None, batch=8, steps=3, rounds=5, seed=0):
    """{"step_s": {variant: seconds}, "max_diff": {variant: vs dense}, "collectives":
    {"ours": {...}, "torch": {...}}} on this rank (run it on every rank)."""
    from course_lib import comm

    cfg = cfg or config()
    device = current_device()
    blocks = build(cfg, seed)
    x, upstream = _inputs(cfg, batch, device)
    want_y, want_dx = _step(blocks["dense"], x, upstream)  # also warms up each variant
    max_diff, collectives = {}, {}
    for name in ("ours", "torch"):
        with comm.counting() as stats:
            y, dx = _step(blocks[name], x, upstream)
        max_diff[name] = max((y - want_y).abs().max().item(), (dx - want_dx).abs().max().item())
        collectives[name] = dict(stats.collectives)
    collectives["torch"] = _torch_comm_counts(blocks["torch"], x, upstream)
    samples = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            samples[name].append(_timed(blocks[name], x, upstream, steps, device))
    return {"step_s": {name: statistics.median(s) for name, s in samples.items()},
            "max_diff": max_diff, "collectives": collectives,
            "shape": {"batch": batch, "seq": cfg.seq_len, "dim": cfg.dim, "heads": cfg.heads}}


def format_table(result, nproc):
    times, shape = result["step_s"], result["shape"]
    lines = [f"one transformer block, forward + backward, t = {nproc} "
             f"(b={shape['batch']}, s={shape['seq']}, h={shape['dim']}, heads={shape['heads']}):",
             f"{'variant':>22} {'ms/step':>9} {'vs torch':>9} {'max |diff| vs dense':>20}"]
    labels = {"ours": "ours (course_lib.tp)", "torch": "torch DTensor TP", "dense": "dense, t = 1"}
    for name in VARIANTS:
        diff = result["max_diff"].get(name)
        lines.append(f"{labels[name]:>22} {times[name] * 1e3:>9.2f} "
                     f"{times[name] / times['torch']:>9.2f} "
                     f"{'-' if diff is None else f'{diff:.1e}':>20}")
    lines.append(f"ratio ours / torch: {times['ours'] / times['torch']:.2f} (target <= 1.1); "
                 f"collectives per step: ours {result['collectives']['ours']}, "
                 f"torch {result['collectives']['torch']}")
    return "\n".join(lines)


def traced_step(cfg=None, batch=8, seed=0):
    """One traced forward and backward of our TP block, after an untraced one.
    Returns the number of all-reduces this rank ran in the traced step."""
    from course_lib import comm

    cfg = cfg or config()
    device = current_device()
    block = parallelize_block(
        init_deterministic(Block(cfg), seed, prefix="blocks.0.").to(device))
    x, upstream = _inputs(cfg, batch, device)
    with trace.paused():
        _step(block, x, upstream)
    dist.barrier()
    with comm.counting() as stats:
        _step(block, x, upstream)
    return stats.collectives["all_reduce"]


def accounting(cfg=None, batch=4, seed=0, collectives="torch"):
    """Our TP block against the dense one on this rank, one forward and backward:
    the largest differences (output, input gradient, any parameter gradient
    against its slice of the dense one) and the collectives counted each way."""
    from course_lib import comm

    cfg = cfg or config()
    device = current_device()
    dense = init_deterministic(Block(cfg), seed, prefix="blocks.0.").to(device)
    with torch.no_grad():  # non-zero biases and LayerNorms: a bias added t times would show
        gen = torch.Generator().manual_seed(seed)
        for p in dense.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen, device="cpu").to(device))
    ours = parallelize_block(copy.deepcopy(dense), collectives=collectives)
    x, upstream = _inputs(cfg, batch, device)
    want_y, want_dx = _step(dense, x, upstream)
    x = x.detach().requires_grad_()
    with comm.counting() as fwd:
        y = ours(x)
    with comm.counting() as bwd:
        y.backward(upstream)
    dense_params = dict(dense.named_parameters())
    worst = max((p.grad - _dense_slice(dense_params[n].grad, n, ours)).abs().max().item()
                for n, p in ours.named_parameters())
    return {"output": (y - want_y).abs().max().item(),
            "input grad": (x.grad - want_dx).abs().max().item(), "param grads": worst,
            "forward": (dict(fwd.collectives), dict(fwd.collective_bytes)),
            "backward": (dict(bwd.collectives), dict(bwd.collective_bytes)),
            "bsh": batch * cfg.seq_len * cfg.dim,
            "local shapes": {n: tuple(p.shape) for n, p in ours.named_parameters()}}


def _dense_slice(full, name, block):
    """The slice of dense tensor ``full`` that parameter ``name`` of TP ``block`` holds."""
    from course_lib.tp.layers import ColumnParallelLinear, RowParallelLinear

    owner, _, kind = name.rpartition(".")
    module = block.get_submodule(owner)
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return module.shard_weight(full) if kind == "weight" else module.shard_bias(full)
    return full  # LayerNorms: whole on every rank


def traffic(cfg=None, batch=4, seed=0):
    """Bytes this rank sends (Lab 01's ring, so every byte is a counted message)
    in one forward and backward of our TP block, without and with sequence
    parallelism: {"tp": {...}, "sequence parallel": {...}}, each with the
    collectives counted and ``sent_bytes``."""
    from course_lib import comm
    from course_lib.tp import scatter_to_sequence, sync_sequence_parallel_grads

    cfg = cfg or config()
    device = current_device()
    dense = init_deterministic(Block(cfg), seed, prefix="blocks.0.").to(device)
    x, upstream = _inputs(cfg, batch, device)
    out = {}
    for label, sp in (("tp", False), ("sequence parallel", True)):
        block = parallelize_block(copy.deepcopy(dense), collectives="ring", sequence_parallel=sp)
        inp, up = x, upstream
        if sp:  # this rank's tokens, handed over before the measured step
            inp = scatter_to_sequence(x, collectives="ring")
            up = scatter_to_sequence(upstream, collectives="ring")
        with comm.counting() as stats:
            block(inp).backward(up)
            if sp:
                sync_sequence_parallel_grads(block, collectives="ring")
        out[label] = {"collectives": dict(stats.collectives), "sent_bytes": stats.sent_bytes,
                      "tokens per rank": inp.shape[0] * inp.shape[1]}
    return out
