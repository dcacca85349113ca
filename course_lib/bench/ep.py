"""A mixture-of-experts layer, expert parallel against the whole layer on every rank,
side by side in one job (Lab 07).

- **ours**: :class:`course_lib.ep.ExpertParallelMoE` at ep = nproc, each rank feeding
  the layer its tokens / nproc of the batch;
- **dense**: the whole :class:`course_lib.ep.MoE`, every expert, on all the tokens on
  every rank (each rank computes alone, so the machine is as busy as with ours).

A step is forward and backward of the layer for a fixed upstream gradient (plus the
aux loss), the tokens requiring grad as inside a network. Each variant's time is the
slowest rank's mean per step, median over rounds that alternate the variants. Ours
splits the batch over the ranks and dense computes all of it on each: either way a
step gets through the batch once, so tokens/s is tokens / step time. Before
timing, every rank's output and input gradient are compared with the dense layer's.
A few traced steps of ours then split a step into all-to-all and expert compute.

Lab 07 also runs from here: :func:`traced_step` (one step for the timeline, with a
balanced router or one biased towards an expert) and :func:`loads` (rows per expert
and per rank under both routers).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import trace
from course_lib.ep import ExpertParallelMoE, MoE
from course_lib.runtime.backend import current_device
from course_lib.runtime.device import sync

VARIANTS = ("ours", "dense")
COMM = ("dispatch", "combine", "combine backward", "dispatch backward")


def capacity_factor_for(experts, top_k, overloaded, capacity_factor=None):
    """``capacity_factor``, or where it is None: MoE's 1.25 for the balanced router and
    E / k for an overloaded one (C = T: an expert may take every token, none drops)."""
    if capacity_factor is not None:
        return capacity_factor
    return 1.25 if overloaded is None else experts / top_k


def overload(moe, expert, strength=4.0):
    """Give ``moe``'s router a bias towards ``expert`` (its weights unchanged).

    For unit-variance tokens expert j's logit has standard deviation |w_j|, so a bias
    of ``strength`` times the largest |w_j| puts ``expert`` first for nearly every
    token: a weight change alone cannot, as a linear map of zero-mean tokens favours
    any expert for only half of them."""
    old = moe.router
    router = nn.Linear(old.in_features, old.out_features, bias=True,
                       device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        router.weight.copy_(old.weight)
        router.bias.zero_()
        router.bias[expert] = strength * old.weight.norm(dim=1).max()
    moe.router = router
    return moe


def build(tokens=4096, dim=256, experts=8, top_k=2, ffn=None, capacity_factor=1.25,
          overloaded=None, seed=0, device=None):
    """(dense MoE, all tokens, upstream gradient) on ``device`` (this rank's by
    default): the same on every rank and on every device."""
    device = device or current_device()
    with torch.device("cpu"):  # initialised by the CPU's generator, whatever the default
        moe = MoE(dim, ffn or 4 * dim, experts, top_k, capacity_factor, seed)
    moe = moe.to(device)
    if overloaded is not None:
        overload(moe, overloaded)
    gen = torch.Generator().manual_seed(seed + 1)  # drawn on the CPU, where the generator is
    x = torch.randn(tokens, dim, generator=gen, device="cpu").to(device)
    return moe, x, torch.randn(tokens, dim, generator=gen, device="cpu").to(device)


def _mine(t, group=None):
    """This rank's rows of ``t`` (contiguous blocks, the first ones a row longer)."""
    return torch.tensor_split(t, dist.get_world_size(group))[dist.get_rank(group)]


def _step(layer, x, upstream):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out, aux = layer(x)
    ((out * upstream).sum() + aux).backward()
    return out, x.grad


def _timed(layer, x, upstream, steps, device, group=None):
    dist.barrier(group=group)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        _step(layer, x, upstream)
    sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64,
                           device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def _split(layer, x, upstream, steps, device, group=None):
    """Seconds per step in this rank's all-to-alls (forward and backward, waits for
    slower ranks included) and in its experts (forward and backward), from ``steps``
    traced steps: [all-to-all, experts, whole step], medians. One more goes first and
    is dropped: a process's first traced step pays for starting tracing's helpers."""
    parts = []
    for _ in range(steps + 1):
        trace.start()  # a barrier, then a recorder of its own (the caller's is paused)
        start = time.perf_counter_ns()
        _step(layer, x, upstream)
        sync(device)
        whole = time.perf_counter_ns() - start
        spans = trace.finish()["spans"]
        comm = sum(s["end_ns"] - s["start_ns"] for s in spans if s["name"] in COMM)
        experts = sum(s["end_ns"] - s["start_ns"] for s in spans
                      if s["name"].startswith("expert "))
        parts.append([comm / 1e9, experts / 1e9, whole / 1e9])
    return [statistics.median(p[i] for p in parts[1:]) for i in range(3)]


def agreement(tokens=256, dim=32, experts=4, top_k=2, capacity_factor=1.25, seed=0,
              all_to_all=None, group=None):
    """On every rank: the largest difference between ours (with ``all_to_all``, the
    library's by default) and the dense layer on all the tokens, over this rank's
    outputs, input gradients and its share of the aux loss's gradient path, and how
    many rows this rank's experts received. Lab 07 runs it with the student's
    all-to-all."""
    moe, x, upstream = build(tokens, dim, experts, top_k, None, capacity_factor, seed=seed)
    extra = {} if all_to_all is None else {"all_to_all": all_to_all}
    layer = ExpertParallelMoE.from_dense(moe, group=group, **extra)
    want_out, want_dx = _step(moe, x, upstream)
    out, dx = _step(layer, _mine(x, group), _mine(upstream, group))
    first = layer.first
    grads = [(p.grad, q.grad) for e, expert in enumerate(layer.experts)
             for p, q in zip(expert.parameters(), moe.experts[first + e].parameters())]
    return {"output": (out - _mine(want_out, group)).abs().max().item(),
            "input grad": (dx - _mine(want_dx, group)).abs().max().item(),
            "expert grads": max((a - b).abs().max().item() for a, b in grads)}


@trace.paused()  # spans cost time: the split below records its own steps
def measure(tokens=4096, dim=256, experts=8, top_k=2, ffn=None, capacity_factor=1.25,
            steps=2, rounds=5, split_steps=3, seed=0, group=None):
    """{"step_s": {variant: s}, "tokens_per_s": {...}, "ratio", "max_diff", "split":
    per rank {"all_to_all_s", "experts_s", "step_s"}, "shape"} (run it on every rank)."""
    device = current_device()
    n = dist.get_world_size(group)
    moe, x, upstream = build(tokens, dim, experts, top_k, ffn, capacity_factor, seed=seed)
    layers = {"ours": ExpertParallelMoE.from_dense(moe, group=group), "dense": moe}
    inputs = {"ours": (_mine(x, group), _mine(upstream, group)), "dense": (x, upstream)}
    want_out, want_dx = _step(moe, x, upstream)  # also warms up each variant
    out, dx = _step(layers["ours"], *inputs["ours"])
    worst = torch.tensor([max((out - _mine(want_out, group)).abs().max().item(),
                              (dx - _mine(want_dx, group)).abs().max().item())],
                         dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    samples = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            samples[name].append(_timed(layers[name], *inputs[name], steps, device, group))
    step_s = {name: statistics.median(s) for name, s in samples.items()}
    split = torch.tensor(_split(layers["ours"], *inputs["ours"], split_steps, device, group),
                         dtype=torch.float64, device=device)
    every = [torch.empty_like(split) for _ in range(n)]
    dist.all_gather(every, split, group=group)
    return {"step_s": step_s, "tokens_per_s": {k: tokens / v for k, v in step_s.items()},
            "ratio": step_s["dense"] / step_s["ours"], "max_diff": worst.item(),
            "split": [dict(zip(("all_to_all_s", "experts_s", "step_s"), s.tolist()))
                      for s in every],
            "shape": {"tokens": tokens, "dim": dim, "ffn": ffn or 4 * dim, "experts": experts,
                      "top_k": top_k, "capacity_factor": capacity_factor, "nproc": n}}


def format_table(result, nproc):
    shape, times, rate = result["shape"], result["step_s"], result["tokens_per_s"]
    e, t = shape["experts"], shape["tokens"]
    lines = [f"one MoE layer, forward + backward, ep = {nproc} ({t} tokens, d={shape['dim']}, "
             f"d_ff={shape['ffn']}, {e} experts, top-{shape['top_k']}, "
             f"capacity factor {shape['capacity_factor']}):",
             f"{'variant':>44} {'ms/step':>9} {'tokens/s':>10}"]
    labels = {"ours": f"ours: {e // nproc} experts, {t // nproc} tokens a rank",
              "dense": f"dense: {e} experts, {t} tokens on every rank"}
    for name in VARIANTS:
        lines.append(f"{labels[name]:>44} {times[name] * 1e3:>9.2f} {rate[name]:>10,.0f}")
    lines.append(f"ratio ours / dense (tokens/s): {result['ratio']:.2f} (ideal {nproc}); "
                 f"max |diff| of outputs and input grads vs dense: {result['max_diff']:.1e}")
    lines.append("ours, a traced step (its spans cost a little), per rank; all-to-all: "
                 "dispatch and combine, forward and backward, counts and waits included:")
    for rank, s in enumerate(result["split"]):
        rest = s["step_s"] - s["all_to_all_s"] - s["experts_s"]
        lines.append(f"  rank {rank}: all-to-all {s['all_to_all_s'] * 1e3:8.2f} ms  "
                     f"experts {s['experts_s'] * 1e3:8.2f} ms  rest {rest * 1e3:8.2f} ms  "
                     f"(step {s['step_s'] * 1e3:.2f} ms)")
    return "\n".join(lines)


def traced_step(tokens=4096, dim=256, experts=8, top_k=2, overloaded=None, ffn=None,
                capacity_factor=None, seed=0, group=None):
    """One traced forward and backward of ours, after an untraced one: for the lab's
    timeline, ``run(traced_step, ...).trace``. ``overloaded=e`` biases the router
    towards expert e (:func:`overload`) with no row dropped, so e's rank computes
    longest. Returns {"experts": this rank's expert ids, "rows": rows each of them
    received, "capacity": C}."""
    from course_lib.ep import capacity

    factor = capacity_factor_for(experts, top_k, overloaded, capacity_factor)
    moe, x, upstream = build(tokens, dim, experts, top_k, ffn, factor, overloaded, seed)
    layer = ExpertParallelMoE.from_dense(moe, group=group)
    mine = (_mine(x, group), _mine(upstream, group))
    with trace.paused():  # the warm-up traced too (into a recorder dropped after), as the
        trace.start()     # first traced step of a process pays for starting its helpers
        _step(layer, *mine)
        trace.finish()
    dist.barrier(group=group)
    _step(layer, *mine)
    ids = list(range(layer.first, layer.first + layer.per_rank))
    per_expert = _routed(moe, x).tolist()
    return {"experts": ids, "rows": [per_expert[e] for e in ids],
            "capacity": capacity(tokens, top_k, experts, factor)}


@torch.no_grad()
def _routed(moe, x):
    """Rows each expert is sent (before capacity) when ``x`` goes through ``moe``."""
    return torch.bincount(moe.route(x)[2].reshape(-1), minlength=moe.n_experts).cpu()


@torch.no_grad()
def _kept(moe, x):
    _, _, chosen, kept = moe.route(x)
    return torch.bincount(chosen[kept], minlength=moe.n_experts).cpu()


def loads(tokens=4096, dim=256, experts=8, top_k=2, nproc=2, overloaded=0, ffn=None,
          capacity_factor=None, seed=0):
    """Rows per expert and per rank under the balanced router and the one biased
    towards expert ``overloaded``, as :func:`traced_step` routes them (in this
    process, no job): {"balanced": {...}, "overloaded": {...}, "expert": e}, each
    with "per_expert" (rows sent, summing to tokens x top_k), "kept" (within
    capacity) and "per_rank" (rows sent to rank r's experts)."""
    if experts % nproc:
        raise ValueError(f"{experts} experts do not split over {nproc} ranks")
    out = {"expert": overloaded, "nproc": nproc, "tokens": tokens, "top_k": top_k}
    for label, biased in (("balanced", None), ("overloaded", overloaded)):
        factor = capacity_factor_for(experts, top_k, biased, capacity_factor)
        moe, x, _ = build(tokens, dim, experts, top_k, ffn, factor, biased, seed,
                          device=torch.device("cpu"))
        sent, kept = _routed(moe, x), _kept(moe, x)
        out[label] = {"per_expert": sent.tolist(), "kept": kept.tolist(),
                      "per_rank": sent.reshape(nproc, -1).sum(1).tolist(),
                      "capacity_factor": factor}
    return out
