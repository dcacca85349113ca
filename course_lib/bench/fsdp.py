"""Step time and memory of data parallelism with and without sharding, side by side (Lab 03).

DDP, DDP + ZeRO-1, ZeRO-2 (no DDP: gradients reduce-scattered), our FSDP (each
sharding, prefetch on and off) and torch's FSDP2 (``fully_shard``, one unit per
block) train the same GPT in one job, alternating in rounds. A step is zero_grad,
forward, cross-entropy, backward, AdamW step; the time is the slowest rank's mean
per step, median over rounds.
Memory is measured per rank for one step of each (``course_lib.memory``), and
:func:`traffic` counts the bytes each rank hands to collectives in one step.
"""
from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import comm
from course_lib.collectives.cost_model import bus_factor
from course_lib.ddp import DDP
from course_lib.fsdp import FSDP, ShardedOptimizer, ZeRO2, by_type
from course_lib.models import GPT, Block, GPTConfig
from course_lib.runtime.backend import current_device, device_mesh
from course_lib.runtime.device import sync


def config(dim=128, layers=4, heads=4, vocab=256, seq_len=64):
    return GPTConfig(vocab=vocab, dim=dim, layers=layers, heads=heads, seq_len=seq_len)


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns that our GPT returns a view; the loss never modifies it in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    # the job's mesh, given explicitly: fully_shard's default mesh takes the accelerator
    # the process sees, and sends gloo ranks on a one-GPU machine to cuda:rank
    mesh = device_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def variants(zero2=ZeRO2):
    """name -> (wrap(model) -> model, optimizer factory). ``zero2``: the class behind
    "ZeRO-2", ``zero2(params, make_optimizer)`` (the student's, in Lab 03)."""
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    zero1 = lambda params: ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)  # noqa: E731
    out = {"DDP": (DDP, adamw), "DDP + ZeRO-1": (DDP, zero1),
           # no DDP around the model: ZeRO-2 reduces the gradients itself
           "ZeRO-2": (lambda model: model, lambda params: zero2(params, adamw))}
    for sharding in ("full", "grad_op", "none"):
        for prefetch in (1, 0):
            name = f"FSDP {sharding}" + ("" if prefetch else ", no prefetch")
            out[name] = ((lambda m, s=sharding, p=prefetch: FSDP(m, units=by_type(Block),
                                                                  sharding=s, prefetch=p)), adamw)
    out["torch FSDP2"] = (_fsdp2, adamw)
    return out


def _step(model, opt, x, y, vocab):
    opt.zero_grad()
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1)).backward()
    opt.step()


def _timed(model, opt, x, y, vocab, steps, device):
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, opt, x, y, vocab)
    sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64,
                           device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def measure(cfg=None, batch=8, steps=3, rounds=3, names=None, zero2=ZeRO2):
    """{variant: {"step_s": seconds per step, "peak_bytes": this rank's peak in a step,
    "state_bytes": parameters + gradients + optimizer state on this rank}} (``zero2``: the
    class behind "ZeRO-2")."""
    from course_lib.memory.measure import _storages, model_state_bytes_of, peak_bytes

    cfg = cfg or config()
    device = current_device()
    gen = torch.Generator().manual_seed(dist.get_rank())
    # drawn on the CPU (the generator's device) whatever the rank's default device is
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen, device="cpu").to(device)
    y = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen, device="cpu").to(device)
    chosen = {k: v for k, v in variants(zero2).items() if names is None or k in names}
    models, opts, result = {}, {}, {}
    for name, (wrap, make_opt) in chosen.items():
        models[name] = wrap(GPT(cfg, seed=0).to(device))
        opts[name] = make_opt(models[name].parameters())
        with peak_bytes(device) as peak:
            _step(models[name], opts[name], x, y, cfg.vocab)  # also the warm-up
        inner = getattr(opts[name], "optimizer", opts[name])
        state = model_state_bytes_of(models[name], inner)["total"]
        if name == "ZeRO-2":  # its gradient is the shard's, held by the optimizer's parameter
            state += _storages(p.grad for g in inner.param_groups for p in g["params"])
        result[name] = {"peak_bytes": peak.peak, "state_bytes": state}
    samples = {name: [] for name in chosen}
    for _ in range(rounds):
        for name in chosen:
            samples[name].append(_timed(models[name], opts[name], x, y, cfg.vocab, steps, device))
    for name in chosen:
        result[name]["step_s"] = statistics.median(samples[name])
    return result


def traffic(cfg=None, batch=4, names=("DDP", "DDP + ZeRO-1", "FSDP full", "FSDP grad_op"),
            zero2=ZeRO2):
    """{variant: {"collective_bytes": {op: S summed over calls}, "sent_bytes": what a ring
    sends per rank for them, sum of S x (K-1)/K (2(K-1)/K for an all-reduce),
    "param_bytes": 4P}} for one step of each variant, counted on this rank (``zero2``: the
    class behind "ZeRO-2")."""
    cfg = cfg or config()
    device, world = current_device(), dist.get_world_size()
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen, device="cpu").to(device)
    y = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen, device="cpu").to(device)
    result = {}
    for name in names:
        wrap, make_opt = variants(zero2)[name]
        model = wrap(GPT(cfg, seed=0).to(device))
        opt = make_opt(model.parameters())
        _step(model, opt, x, y, cfg.vocab)  # the first step rebuilds DDP's buckets
        with comm.counting() as stats:
            _step(model, opt, x, y, cfg.vocab)
        counted = dict(stats.collective_bytes)
        result[name] = {"collective_bytes": counted,
                        "sent_bytes": sum(n * bus_factor(op, world) for op, n in counted.items()),
                        "param_bytes": 4 * sum(p.numel() for p in GPT(cfg).parameters())}
    return result


def format_table(result, nproc):
    ref = result.get("torch FSDP2", {}).get("step_s")
    lines = [f"GPT training step on {nproc} ranks (rank 0's memory):",
             f"{'variant':>24} {'ms/step':>9} {'vs FSDP2':>9} {'state MB':>9} {'peak MB':>9}"]
    for name, r in result.items():
        ratio = f"{r['step_s'] / ref:.2f}" if ref else "-"
        lines.append(f"{name:>24} {r['step_s'] * 1e3:>9.1f} {ratio:>9} "
                     f"{r['state_bytes'] / 1e6:>9.2f} {r['peak_bytes'] / 1e6:>9.2f}")
    return "\n".join(lines)


def traced_step(cfg=None, batch=8, prefetch=1, sharding="full", prefetch_plan=None):
    """One traced step of our FSDP (after an untraced one that fixes the order):
    per unit, its forward and backward (compute) and its all-gathers and
    reduce-scatters (comm). ``prefetch_plan``: which units to prefetch (the
    student's, in Lab 03; FSDP's own by default). Returns the number of units."""
    from course_lib import trace

    cfg = cfg or config()
    device = current_device()
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen, device="cpu").to(device)
    model = FSDP(GPT(cfg, seed=0).to(device), units=by_type(Block), sharding=sharding,
                 prefetch=prefetch, prefetch_plan=prefetch_plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with trace.paused():
        _step(model, opt, x, x, cfg.vocab)
    dist.barrier()
    _step(model, opt, x, x, cfg.vocab)
    return len(model.units)


def compare_wraps(cfg=None, batch=4, policies=None):
    """{policy name: {"units", "all_gathers" per step, "gathered_bytes" per step,
    "peak_bytes" of a step}} on this rank for full sharding under each wrap policy
    (one job, the same model and batch): smaller units, more collectives, a lower peak."""
    from course_lib import comm
    from course_lib.fsdp import by_size
    from course_lib.memory.measure import peak_bytes

    cfg = cfg or config()
    device = current_device()
    block = sum(p.numel() for p in Block(cfg).parameters())
    policies = policies or {"by_type(Block)": by_type(Block), f"by_size({block // 2})":
                            by_size(block // 2), "one unit (None)": None}
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen, device="cpu").to(device)
    out = {}
    for name, policy in policies.items():
        model = FSDP(GPT(cfg, seed=0).to(device), units=policy, sharding="full")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _step(model, opt, x, x, cfg.vocab)  # the first step learns the order
        with comm.counting() as stats, peak_bytes(device) as peak:
            _step(model, opt, x, x, cfg.vocab)
        out[name] = {"units": len(model.units), "all_gathers": stats.collectives["all_gather"],
                     "gathered_bytes": stats.collective_bytes["all_gather"],
                     "peak_bytes": peak.peak}
    return out


def hybrid_step(cfg=None, batch=4):
    """One step of HYBRID_SHARD on a (replicate=2, shard=world/2) mesh: this rank's
    collective calls and bytes (all-gathers and reduce-scatters stay in its shard
    group; the all-reduce of gradient shards crosses to the other replica)."""
    from course_lib import comm

    cfg = cfg or config()
    world = dist.get_world_size()
    if world % 2:
        raise ValueError(f"a 2 x n mesh needs an even world size, got {world}")
    device = current_device()
    mesh = device_mesh((2, world // 2), ("replicate", "shard"))
    model = FSDP(GPT(cfg, seed=0).to(device), units=by_type(Block), sharding="hybrid", mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen, device="cpu").to(device)
    _step(model, opt, x, x, cfg.vocab)
    with comm.counting() as stats:
        _step(model, opt, x, x, cfg.vocab)
    return {"calls": dict(stats.collectives), "bytes": dict(stats.collective_bytes),
            "shard_group": dist.get_process_group_ranks(mesh.get_group("shard")),
            "replicate_group": dist.get_process_group_ranks(mesh.get_group("replicate"))}


def projected_steps(shape, gpu, global_batch=64, efficiency=0.5):
    """What a GPU node would show (projected, not measured): one step of ``shape`` data
    parallel over the ``gpu.gpus_per_node`` GPUs of one node, at ZeRO stages 0-3, with
    the planner's step model (:func:`course_lib.hybrid.costs.step_time`: compute at
    ``efficiency`` of the bf16 peak, the dp traffic that compute cannot hide). Returns
    {"ZeRO-z": {"compute", "dp_comm" (exposed), "dp_comm_alone" (all of it, as if
    nothing overlapped), "total"}} in seconds."""
    from course_lib.hybrid.costs import (Mesh, Workload, _link, dp_exposed, params_per_gpu,
                                         step_time)

    mesh = Mesh(dp=gpu.gpus_per_node)
    out = {}
    for zero in range(4):
        work = Workload(global_batch=global_batch, zero=zero)
        step = step_time(shape, mesh, work, gpu, efficiency)
        grad_bytes = 2 * params_per_gpu(shape, mesh)  # bf16, as step_time counts it
        alone = dp_exposed(grad_bytes, mesh.dp, work.microbatches(mesh), zero, 0.0, 0.0,
                           _link(gpu, mesh, "dp"))
        out[f"ZeRO-{zero}"] = {"compute": step["compute"], "dp_comm": step["dp_comm"],
                               "dp_comm_alone": alone, "total": step["total"]}
    return out

