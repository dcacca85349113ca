"""Causal attention with context parallelism, side by side in one job (Lab 07).

A step is forward and backward of causal attention on (batch, heads, seq, head_dim)
for a fixed upstream gradient:

- **ours**: :func:`course_lib.cp.ring_attention` on this rank's chunk, zigzag and
  contiguous layouts, each piece of a block on a fused kernel of
  ``scaled_dot_product_attention`` (flash; memory-efficient for float32 on a GPU),
  through its op that returns the log-sum-exp, by which the pieces merge
  (:mod:`course_lib.cp.fused`);
- **torch**: ``torch.distributed.tensor.experimental.context_parallel`` (its ring
  under ``scaled_dot_product_attention``, head-tail load balancing: our zigzag).
  It shards only the fused kernels' ops (flash, memory-efficient, cuDNN: GPU
  kernels); on the CPU, ``scaled_dot_product_attention`` calls
  ``_scaled_dot_product_flash_attention_for_cpu``, for which DTensor has no sharding
  rule, so the column reports that error instead of a time;
- **dense**: ``scaled_dot_product_attention`` on the whole sequence, on every rank
  (each rank computes alone, so the machine is as busy as in the others).

Each time is the slowest rank's mean per step, median over rounds that alternate
the variants; outputs and q, k, v gradients are compared with dense first.

Lab 07 also runs from here: :func:`traced_step` (one step for the timeline: the k/v
exchanges in the comm lane under the "attention block N" compute spans),
:func:`imbalance` (compute per rank, contiguous against zigzag, from the spans) and
:func:`memory` (activation bytes per rank measured against
:func:`~course_lib.cp.memory.activation_bytes`, and the dense layer's).
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import trace
from course_lib.cp.blockwise import causal_mask, chunk_positions
from course_lib.cp.ring_attention import ring_attention
from course_lib.runtime.backend import backend_for, current_device, device_mesh
from course_lib.runtime.device import sync

VARIANTS = ("zigzag", "contiguous", "torch", "dense")
LAYOUTS = ("zigzag", "contiguous")


def _whole(batch, heads, seq, head_dim, seed, device):
    # the same on every rank; drawn on the CPU, where the generator is
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(batch, heads, seq, head_dim, generator=gen, device="cpu").to(device)
            for _ in range(4)]  # q, k, v and the output's gradient


def _dense_step(q, k, v, g):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


def _ring_step(q, k, v, g, group, layout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, group=group, causal=True, layout=layout)
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


@contextmanager
def sdpa_restored():
    """Put torch's attention dispatch back as it was on the way out, even when the body
    raises. ``context_parallel`` swaps ``F.scaled_dot_product_attention`` for its ring
    and registers DTensor handlers; torch 2.11 leaves them in place when the body
    raises (as it does on CPU ranks, which have no sharding rule for the CPU flash
    kernel), and every later dense attention of the process then goes through the
    ring's dispatch and fails."""
    from torch.distributed.tensor import DTensor

    sdpa = F.scaled_dot_product_attention
    dispatcher = DTensor._op_dispatcher
    handlers = dict(dispatcher._custom_op_handlers)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
        dispatcher._custom_op_handlers = handlers


def _torch_steps(mesh, whole, steps):
    """``steps`` steps under torch's context parallelism, which shards its buffers in
    place on entry (one entry per round: the sharding is not the attention's cost)."""
    from torch.distributed.tensor.experimental import context_parallel

    buffers = [t.clone() for t in whole]
    got = None
    with sdpa_restored(), context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4,
                                           no_restore_buffers=set(buffers)):
        for _ in range(steps):
            q, k, v = (t.detach().requires_grad_() for t in buffers[:3])
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(buffers[3])
            got = out.detach(), q.grad, k.grad, v.grad
    return got


def _local(tensors, positions):
    return [t.index_select(2, positions).contiguous() for t in tensors]


def _max_diff(got, want, positions):
    return max((a - b).abs().max().item() for a, b in zip(got, _local(want, positions)))


def _timed(steps_fn, steps, group, device):
    dist.barrier(group=group)
    sync(device)
    start = time.perf_counter()
    steps_fn(steps)
    sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64,
                           device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def _all_max(values, group, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


@trace.paused()  # spans cost time; the timeline has its own traced step
def measure(batch=1, heads=8, seq=1024, head_dim=32, steps=2, rounds=5, seed=0, group=None):
    """{"step_s": {variant: s}, "max_diff": {variant: vs dense}, "torch_error": str or
    None, "shape": {...}} (run it on every rank; every rank returns the same)."""
    group = group or dist.group.WORLD
    n, r = dist.get_world_size(group), dist.get_rank(group)
    device = current_device()
    whole = _whole(batch, heads, seq, head_dim, seed, device)
    want = _dense_step(*whole)
    steps_fns = {"dense": lambda k: [_dense_step(*whole) for _ in range(k)]}
    diffs = {}
    for layout in LAYOUTS:
        positions = chunk_positions(r, n, seq, layout).to(device)
        local = _local(whole, positions)
        diffs[layout] = _max_diff(_ring_step(*local, group, layout), want, positions)
        steps_fns[layout] = (lambda k, local=local, layout=layout:
                             [_ring_step(*local, group, layout) for _ in range(k)])
    mesh = device_mesh(group=group)
    torch_error = None
    try:  # the head-tail layout when the sequence cuts into 2n chunks, else contiguous
        balanced = "zigzag" if seq % (2 * n) == 0 else "contiguous"
        diffs["torch"] = _max_diff(_torch_steps(mesh, whole, 1), want,
                                   chunk_positions(r, n, seq, balanced).to(device))
        steps_fns["torch"] = lambda k: _torch_steps(mesh, whole, k)
    except Exception as exc:  # noqa: BLE001 -- reported in the table, not fatal
        torch_error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    failed = _all_max([float(torch_error is not None)], group, device)[0]
    if failed and torch_error is None:  # every rank times the same variants
        torch_error = "failed on another rank"
    names = [v for v in VARIANTS if v in steps_fns and not (v == "torch" and failed)]
    worst = dict(zip(diffs, _all_max(list(diffs.values()), group, device)))
    samples = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            samples[name].append(_timed(steps_fns[name], steps, group, device))
    return {"step_s": {name: statistics.median(s) for name, s in samples.items()},
            "max_diff": {k: v for k, v in worst.items() if k in names}, "torch_error": torch_error,
            "shape": {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "cp": n}}


def blocks_computed(rank, world, layout):
    """How many k/v blocks rank ``rank`` attends to in causal ring attention (a block
    no query of the rank may see is skipped)."""
    mine = chunk_positions(rank, world, 2 * world, layout)
    return sum(bool(causal_mask(mine, chunk_positions(o, world, 2 * world, layout)).any())
               for o in range(world))


def traced_step(batch=1, heads=4, seq=256, head_dim=16, layout="zigzag", seed=0, group=None):
    """One traced forward and backward of ring attention, after an untraced one (for
    the timeline: ``run(traced_step, ...).trace``). Returns the number of blocks this
    rank computed in the forward."""
    group = group or dist.group.WORLD
    n, r = dist.get_world_size(group), dist.get_rank(group)
    device = current_device()
    positions = chunk_positions(r, n, seq, layout).to(device)
    local = _local(_whole(batch, heads, seq, head_dim, seed, device), positions)
    with trace.paused():
        _ring_step(*local, group, layout)
    dist.barrier(group=group)
    _ring_step(*local, group, layout)
    sync(device)
    return blocks_computed(r, n, layout)


def block_work(spans_trace):
    """Per rank, from a traced step's spans: forward blocks computed, the query-key
    scores they computed (the work: a zigzag rank skips half of another rank's block)
    and the seconds they took; the same for the backward."""
    rows = []
    for rank in spans_trace.ranks:
        compute = spans_trace.select(rank=rank, cat="compute")
        fwd = [s for s in compute if s.name.startswith("attention block ")]
        bwd = [s for s in compute if s.name.startswith("attention backward block ")]
        rows.append({"rank": rank, "blocks": len(fwd), "forward_s": sum(s.duration for s in fwd),
                     "scores": sum(s.args.get("scores", 0) for s in fwd),
                     "backward_blocks": len(bwd),
                     "backward_s": sum(s.duration for s in bwd)})
    return rows


def imbalance(nproc=4, batch=1, heads=4, seq=1024, head_dim=32, backend="auto", timeout=600):
    """{layout: per-rank rows of :func:`block_work`} for causal ring attention under
    the contiguous and the zigzag layouts (run from the notebook side; on gloo where
    the node has fewer GPUs than ``nproc``, :func:`~course_lib.runtime.backend.backend_for`)."""
    from course_lib.runtime.launcher import run

    backend = backend_for(nproc, backend)
    return {layout: block_work(run(traced_step, batch, heads, seq, head_dim, layout,
                                   nproc=nproc, backend=backend, timeout=timeout).trace)
            for layout in ("contiguous", "zigzag")}


def _memory_job(batch, seq, dim, heads, layout, dense):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from course_lib.cp import ContextParallelAttention
    from course_lib.cp.memory import saved_bytes
    from course_lib.models import CausalSelfAttention, GPTConfig, init_deterministic

    n, r = dist.get_world_size(), dist.get_rank()
    device = current_device()
    cfg = GPTConfig(vocab=2, dim=dim, layers=1, heads=heads, seq_len=seq)
    attn = init_deterministic(CausalSelfAttention(cfg), 0, prefix="blocks.0.attn.").to(device)
    layer = ContextParallelAttention.from_dense(attn, group=dist.group.WORLD, layout=layout)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, seq, dim, generator=gen, device="cpu").to(device)
    local = x[:, chunk_positions(r, n, seq, layout).to(device)].requires_grad_()
    out = {"measured": saved_bytes(layer, local)[1]}
    if dense:  # in the same job, on the same device
        for kernel, backend in (("fused", None), ("math", SDPBackend.MATH)):
            x.requires_grad_()
            if backend is None:
                out[f"dense_{kernel}"] = saved_bytes(attn, x)[1]
            else:
                with sdpa_kernel(backend):
                    out[f"dense_{kernel}"] = saved_bytes(attn, x)[1]
    return out


def memory(cps=(1, 2, 4), batch=1, seq=4096, dim=256, heads=8, layout="zigzag",
           backend="auto", timeout=600):
    """Rows {"cp", "measured" (per rank, the largest), "formula", "dense_fused",
    "dense_math" (each measured, with its formula under "..._formula")}: one layer's
    activations per rank (run from the notebook side; forward only; a cp the node has
    too few GPUs for runs on gloo)."""
    from course_lib.cp.memory import activation_bytes, dense_activation_bytes
    from course_lib.runtime.launcher import run

    dense, rows = None, []
    for cp in cps:
        per_rank = run(_memory_job, batch, seq, dim, heads, layout, dense is None, nproc=cp,
                       backend=backend_for(cp, backend), timeout=timeout)
        if dense is None:
            dense = {k: v for k, v in per_rank[0].items() if k.startswith("dense")}
        rows.append({"cp": cp, "measured": max(p["measured"] for p in per_rank),
                     "per_rank": [p["measured"] for p in per_rank],
                     "formula": activation_bytes(batch, seq, dim, heads, cp)})
    for row in rows:
        row.update(dense)
        for kernel in ("fused", "math"):
            row[f"dense_{kernel}_formula"] = dense_activation_bytes(batch, seq, dim, heads,
                                                                    kernel=kernel)
    return rows


def format_table(result, nproc, imbalance_rows=None, memory_rows=None):
    times, shape = result["step_s"], result["shape"]
    lines = [f"causal attention, forward + backward, cp = {nproc} (b={shape['batch']}, "
             f"heads={shape['heads']}, s={shape['seq']}, d={shape['head_dim']}):",
             f"{'variant':>26} {'ms/step':>9} {'max |diff| vs dense':>20}"]
    labels = {"zigzag": "ours, ring (zigzag)", "contiguous": "ours, ring (contiguous)",
              "torch": "torch context_parallel", "dense": "dense SDPA, whole seq"}
    for name in VARIANTS:
        if name not in times:
            lines.append(f"{labels[name]:>26} {'-':>9} {'-':>20}  ({result['torch_error']})")
            continue
        diff = result["max_diff"].get(name)
        lines.append(f"{labels[name]:>26} {times[name] * 1e3:>9.2f} "
                     f"{'-' if diff is None else f'{diff:.1e}':>20}")
    ratios = [f"ours (zigzag) / dense: {times['zigzag'] / times['dense']:.2f}",
              f"contiguous / zigzag: {times['contiguous'] / times['zigzag']:.2f}"]
    ratios.insert(0, f"ours (zigzag) / torch: {times['zigzag'] / times['torch']:.2f}"
                  if "torch" in times else "ours / torch: n/a (torch did not run)")
    lines.append("ratios: " + "; ".join(ratios))
    for layout, rows in (imbalance_rows or {}).items():
        lines.append(f"{layout} layout, per rank: forward blocks / forward ms / backward ms: "
                     + ", ".join(f"r{w['rank']} {w['blocks']} / {w['forward_s'] * 1e3:.1f} / "
                                 f"{w['backward_s'] * 1e3:.1f}" for w in rows))
    if memory_rows:
        m = memory_rows[0]
        lines.append(f"activations of one layer per rank, MiB (measured = formula?); dense "
                     f"fused {m['dense_fused'] / 2**20:.2f}, dense math (s x s) "
                     f"{m['dense_math'] / 2**20:.2f}:")
        for m in memory_rows:
            lines.append(f"  cp = {m['cp']}: {m['measured'] / 2**20:8.2f} "
                         f"({'=' if m['measured'] == m['formula'] else '!='} "
                         f"{m['formula'] / 2**20:.2f})")
    return "\n".join(lines)
