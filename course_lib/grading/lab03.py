"""Checks of Lab 03's exercises: memory you can predict, and sharding it away.

3.1 and 3.2 are formulas, checked in the notebook's process against models
built with torch (``numel``) and against the lecture's figures; 3.3 is the
padding arithmetic of a flat parameter, checked on sizes that do not divide;
3.4 is ZeRO-1's step, trained under torchrun at world sizes 1-3 against
unsharded AdamW on the whole batch, with its optimizer state measured.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.ddp import DDP
from course_lib.grading import checks
from course_lib.memory.estimate import OLMO, model_state_bytes
from course_lib.models import GPT, GPTConfig, deep_mlp


def check_param_count(param_count, trials=12):
    ex = "Exercise 3.1"
    with checks.in_process(ex, param_count):
        rng = random.Random(0)
        for _ in range(trials):
            heads = rng.choice([1, 2, 4])
            cfg = GPTConfig(vocab=rng.randint(5, 80), dim=heads * rng.randint(2, 9),
                            layers=rng.randint(1, 4), heads=heads, seq_len=rng.randint(2, 20))
            want = sum(p.numel() for p in GPT(cfg).parameters())
            got = param_count(cfg.vocab, cfg.dim, cfg.seq_len, cfg.layers)
            hint = _param_hint(got, want, cfg)
            checks.expect_equal(ex, got, want, rank=0, world_size=1,
                                what=f"param_count(V={cfg.vocab}, D={cfg.dim}, T={cfg.seq_len}, "
                                     f"N={cfg.layers}) against numel() of the course's GPT",
                                hint=hint)
        seventy = OLMO["OLMo 70B"]
        got = param_count(seventy.vocab, seventy.dim, seventy.seq_len, seventy.layers)
        checks.expect_equal(ex, got, 65_288_471_656, rank=0, world_size=1,
                            what="the lecture's 70B OLMo configuration")
    checks.passed(ex, f"{trials} random GPTs and the lecture's 65,288,471,656")


def _param_hint(got, want, cfg):
    v, d, t, n = cfg.vocab, cfg.dim, cfg.seq_len, cfg.layers
    missing = {"the blocks, N(12D^2 + 10D)": n * (12 * d * d + 10 * d),
               "the embeddings, D(V + T)": d * (v + t), "the final LayerNorm, 2D": 2 * d,
               "the output layer with its bias, V(D + 1)": v * (d + 1), "the output bias, V": v}
    for what, amount in missing.items():
        if want - got == amount:
            return f"you left out {what}"
    return "P = N(12D^2 + 10D) + D(V + T) + 2D + V(D + 1)"


def check_zero_bytes(zero_bytes, trials=200):
    ex = "Exercise 3.2"
    hints = {0: "stage 0 is DDP: 2P + 2P + 12P = 16P on every rank",
             1: "stage 1 shards only the optimizer state: 2P + 2P + 12P/n",
             2: "stage 2 shards the gradients too: 2P + (2P + 12P)/n",
             3: "stage 3 shards everything: 16P/n"}
    with checks.in_process(ex, zero_bytes):
        rng = random.Random(1)
        cases = [(7_000_000_000, 8, s) for s in range(4)]
        cases += [(rng.randint(1, 10**10), rng.randint(1, 64), rng.randint(0, 3))
                  for _ in range(trials)]
        for p, n, stage in cases:
            want = model_state_bytes(p, n, stage)["total"]
            got = zero_bytes(p, n, stage)
            if abs(got - want) > 1e-6 * want:
                raise checks.CheckFailed(
                    f"{ex}: zero_bytes(P={p:,}, n={n}, stage={stage}) = {got:,.0f}, expected "
                    f"{want:,.0f} bytes per rank ({got / p:.3f} P instead of {want / p:.3f} P)."
                    f"\nHint: {hints[stage]} (bf16 parameters and gradients, fp32 Adam state "
                    f"with a master copy).")
    checks.passed(ex, f"{len(cases)} cases, stages 0-3")


def check_shard_bounds(shard_bounds, trials=300):
    ex = "Exercise 3.3"
    with checks.in_process(ex, shard_bounds):
        rng = random.Random(2)
        cases = [(10, 3), (9, 3), (1, 4), (0, 2), (7, 1)]
        cases += [(rng.randint(0, 1000), rng.randint(1, 9)) for _ in range(trials)]
        for numel, world in cases:
            padded = -(-numel // world) * world if numel else world
            size = padded // world
            for rank in range(world):
                got = shard_bounds(numel, rank, world)
                want = (rank * size, (rank + 1) * size, padded)
                checks.expect_equal(
                    ex, tuple(got), want, rank=rank, world_size=world,
                    what=f"shard_bounds(numel={numel}, rank={rank}, world={world}) as "
                         f"(start, end, padded)",
                    hint="pad the flat buffer to the next multiple of the world size (at least "
                         "one element per rank), then every rank gets padded // world "
                         "elements, rank r from r * size")
    checks.passed(ex, f"{len(cases)} sizes, every rank")


STEPS, ROWS = 3, 4


def _zero1_job(step_fn):
    """Train with the student's ZeRO-1 step; return params and this rank's state bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = deep_mlp(17, 2, inputs=13, outputs=5, seed=0)
    model = DDP(net)
    params = list(net.parameters())
    numel = sum(p.numel() for p in params)
    size = -(-numel // world)
    flat = torch.zeros(size * world)
    flat[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
    shard = torch.nn.Parameter(flat[rank * size:(rank + 1) * size].clone())
    opt = torch.optim.AdamW([shard], lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(ROWS * world, 13, generator=gen), torch.randn(ROWS * world, 5, generator=gen)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    for _ in range(STEPS):
        for p in params:
            p.grad = None
        F.mse_loss(model(x[mine]), y[mine]).backward()
        step_fn(params, shard, opt)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.numel() > 1)
    return [p.detach().clone() for p in params], state, size


def check_zero1_step(zero1_step, world_sizes=(1, 2, 3)):
    ex = "Exercise 3.4"
    for n in world_sizes:
        outs = checks.launch(ex, _zero1_job, zero1_step, nproc=n)
        ref = deep_mlp(17, 2, inputs=13, outputs=5, seed=0)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        gen = torch.Generator().manual_seed(3)
        x, y = torch.randn(ROWS * n, 13, generator=gen), torch.randn(ROWS * n, 5, generator=gen)
        for _ in range(STEPS):
            opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            opt.step()
        for rank, (params, state, size) in enumerate(outs):
            for i, (got, want) in enumerate(zip(params, ref.parameters())):
                checks.expect_close(ex, got, want.detach(), rank=rank, world_size=n, rtol=1e-5,
                                    atol=1e-6, what=f"parameter {i} after {STEPS} AdamW steps "
                                                    f"(vs unsharded AdamW on the whole batch)",
                                    hint="give the shard the slice [rank*size, (rank+1)*size) "
                                         "of the flat gradient, step, then all-gather the "
                                         "updated shards and copy each parameter's part back")
            checks.expect_equal(ex, state, 8 * size, rank=rank, world_size=n,
                                what="bytes of AdamW state on this rank (exp_avg, exp_avg_sq)")
    checks.passed(ex, f"world sizes {list(world_sizes)}, {STEPS} steps as unsharded AdamW with "
                      f"1/n of its state per rank")

