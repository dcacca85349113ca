"""Checks of Lab 03's exercises: memory you can predict, and sharding it away.

3.1 and 3.2 are formulas, run in the student's process and checked here against
models built with torch (``numel``) and against the lecture's figures; 3.3 is the
padding arithmetic of a flat parameter, checked on sizes that do not divide;
3.4 is ZeRO-1's step, trained under torchrun at world sizes 1-3 against
unsharded AdamW on the whole batch (computed here), with its optimizer state
measured. The job below runs on the student's ranks and only reports; the checks
compare, with references of their own.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.ddp import DDP
from course_lib.grading import checks, salt, wire
from course_lib.grading.requests import call_each, here, on_ranks
from course_lib.memory.estimate import OLMO, model_state_bytes
from course_lib.models import GPT, GPTConfig, deep_mlp

STEPS, ROWS = 3, 4


def _adamw(params):
    # eps well above float32's rounding of a gradient: Adam's first step moves every
    # element by about lr * sign(g), so with torch's eps=1e-8 an element whose gradient is
    # within rounding of zero moves by anything from -lr to lr depending on the order the
    # ranks' gradients were summed in, and about one seed in a hundred fails a right answer
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)


# ---- on the student's ranks ------------------------------------------------------------------
def zero1_job(step_fn):
    """Train with the student's ZeRO-1 step; return params and this rank's state bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = deep_mlp(17, 2, inputs=13, outputs=5, seed=0)
    model = DDP(net)
    params = list(net.parameters())
    numel = sum(p.numel() for p in params)
    size = -(-numel // world)
    flat = torch.zeros(size * world, device="cpu")
    flat[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
    shard = torch.nn.Parameter(flat[rank * size:(rank + 1) * size].clone())
    opt = _adamw([shard])
    x, y = _zero1_batch(world)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    talked = []  # per step: the collectives and messages of the student's step alone
    for _ in range(STEPS):
        for p in params:
            p.grad = None
        F.mse_loss(model(x[mine]), y[mine]).backward()
        with wire.counting() as traffic:
            step_fn(params, shard, opt)
        talked.append(sum(traffic.collective_calls.values()) + traffic.sent_messages)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.numel() > 1)
    return [p.detach().clone() for p in params], state, size, talked


def _zero1_batch(world):
    gen = torch.Generator(device="cpu").manual_seed(3)
    return (torch.randn(ROWS * world, 13, generator=gen, device="cpu"),
            torch.randn(ROWS * world, 5, generator=gen, device="cpu"))


# ---- the checks ------------------------------------------------------------------------------
def answered(ex, answer, call):
    """The value of one :func:`~course_lib.grading.requests.call_each` answer for ``call``
    (its text), or CheckFailed saying what the student's function raised."""
    if "raised" in answer:
        raise checks.CheckFailed(f"{ex}: {call} raised {answer['raised']}: {answer['message']}",
                                 exercise=ex)
    return answer["value"]


@checks.check("Exercise 3.1", hidden=checks.reseeded)
def check_param_count(param_count, trials=12, seed=0):
    ex = "Exercise 3.1"
    rng = random.Random(seed)
    configs = []
    for _ in range(trials):
        heads = rng.choice([1, 2, 4])
        configs.append(GPTConfig(vocab=rng.randint(5, 80), dim=heads * rng.randint(2, 9),
                                 layers=rng.randint(1, 4), heads=heads,
                                 seq_len=rng.randint(2, 20)))
    seventy = OLMO["OLMo 70B"]
    calls = [((c.vocab, c.dim, c.seq_len, c.layers), {}) for c in configs]
    calls.append(((seventy.vocab, seventy.dim, seventy.seq_len, seventy.layers), {}))
    answers = yield here(call_each, param_count, calls)
    for cfg, answer in zip(configs, answers):
        want = sum(p.numel() for p in GPT(cfg).parameters())
        what = (f"param_count(V={cfg.vocab}, D={cfg.dim}, T={cfg.seq_len}, N={cfg.layers})")
        got = answered(ex, answer, what)
        checks.expect_equal(ex, got, want, rank=0, world_size=1,
                            what=f"{what} against numel() of the course's GPT",
                            hint=_param_hint(got, want, cfg))
    got = answered(ex, answers[-1], "param_count(the lecture's 70B OLMo configuration)")
    checks.expect_equal(ex, got, 65_288_471_656, rank=0, world_size=1,
                        what="the lecture's 70B OLMo configuration")
    return f"{trials} random GPTs and the lecture's 65,288,471,656"


def _param_hint(got, want, cfg):
    v, d, t, n = cfg.vocab, cfg.dim, cfg.seq_len, cfg.layers
    missing = {"the blocks, N(12D^2 + 10D)": n * (12 * d * d + 10 * d),
               "the embeddings, D(V + T)": d * (v + t), "the final LayerNorm, 2D": 2 * d,
               "the output layer with its bias, V(D + 1)": v * (d + 1), "the output bias, V": v}
    for what, amount in missing.items():
        if _is_number(got) and want - got == amount:
            return f"you left out {what}"
    return "P = N(12D^2 + 10D) + D(V + T) + 2D + V(D + 1)"


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@checks.check("Exercise 3.2", hidden=checks.reseeded)
def check_zero_bytes(zero_bytes, trials=200, seed=1):
    ex = "Exercise 3.2"
    hints = {0: "stage 0 is DDP: 2P + 2P + 12P = 16P on every rank",
             1: "stage 1 shards only the optimizer state: 2P + 2P + 12P/n",
             2: "stage 2 shards the gradients too: 2P + (2P + 12P)/n",
             3: "stage 3 shards everything: 16P/n"}
    rng = random.Random(seed)
    cases = [(7_000_000_000, 8, s) for s in range(4)]
    cases += [(rng.randint(1, 10**10), rng.randint(1, 64), rng.randint(0, 3))
              for _ in range(trials)]
    answers = yield here(call_each, zero_bytes, [(case, {}) for case in cases])
    for (p, n, stage), answer in zip(cases, answers):
        want = model_state_bytes(p, n, stage)["total"]
        call = f"zero_bytes(P={p:,}, n={n}, stage={stage})"
        got = answered(ex, answer, call)
        if not _is_number(got):
            raise checks.CheckFailed(f"{ex}: {call} returned {got!r}, expected a number of "
                                     f"bytes ({want:,.0f}).", exercise=ex)
        if abs(got - want) > 1e-6 * want:
            raise checks.CheckFailed(
                f"{ex}: {call} = {got:,.0f}, expected "
                f"{want:,.0f} bytes per rank ({got / p:.3f} P instead of {want / p:.3f} P)."
                f"\nHint: {hints[stage]} (bf16 parameters and gradients, fp32 Adam state "
                f"with a master copy).")
    return f"{len(cases)} cases, stages 0-3"


@checks.check("Exercise 3.3", hidden=checks.reseeded)
def check_shard_bounds(shard_bounds, trials=300, seed=2):
    ex = "Exercise 3.3"
    rng = random.Random(seed)
    cases = [(10, 3), (9, 3), (1, 4), (0, 2), (7, 1)]
    cases += [(rng.randint(0, 1000), rng.randint(1, 9)) for _ in range(trials)]
    calls = [(numel, rank, world) for numel, world in cases for rank in range(world)]
    answers = iter((yield here(call_each, shard_bounds, [(c, {}) for c in calls])))
    for numel, world in cases:
        padded = -(-numel // world) * world if numel else world
        size = padded // world
        for rank in range(world):
            what = f"shard_bounds(numel={numel}, rank={rank}, world={world})"
            got = answered(ex, next(answers), what)
            want = (rank * size, (rank + 1) * size, padded)
            checks.expect_equal(
                ex, tuple(got) if isinstance(got, (list, tuple)) else got, want, rank=rank,
                world_size=world, what=f"{what} as (start, end, padded)",
                hint="pad the flat buffer to the next multiple of the world size (at least "
                     "one element per rank), then every rank gets padded // world "
                     "elements, rank r from r * size")
    return f"{len(cases)} sizes, every rank"


@checks.check("Exercise 3.4", hidden=salt.draw)
def check_zero1_step(zero1_step, world_sizes=(1, 2, 3)):
    ex = "Exercise 3.4"
    for n in world_sizes:
        outs = yield on_ranks(zero1_job, zero1_step, nproc=n)
        ref = deep_mlp(17, 2, inputs=13, outputs=5, seed=0)
        size = -(-sum(p.numel() for p in ref.parameters()) // n)  # each rank's shard
        opt = _adamw(ref.parameters())
        x, y = _zero1_batch(n)
        for _ in range(STEPS):
            opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            opt.step()
        for rank, (params, state, _, talked) in enumerate(outs):
            if n > 1 and not all(talked):
                raise checks.CheckFailed(
                    f"{ex}: rank {rank} of world size {n}: a step of yours sent nothing and "
                    f"called no collective, so no rank can hold the others' updated shards."
                    f"\nHint: after stepping your shard, all-gather the shards and copy each "
                    f"parameter's part back.", exercise=ex)
            for i, (got, want) in enumerate(zip(params, ref.parameters())):
                checks.expect_close(ex, got, want.detach(), rank=rank, world_size=n, rtol=1e-4,
                                    atol=1e-5, what=f"parameter {i} after {STEPS} AdamW steps "
                                                    f"(vs unsharded AdamW on the whole batch)",
                                    hint="give the shard the slice [rank*size, (rank+1)*size) "
                                         "of the flat gradient, step, then all-gather the "
                                         "updated shards and copy each parameter's part back")
            checks.expect_equal(ex, state, 8 * size, rank=rank, world_size=n,
                                what="bytes of AdamW state on this rank (exp_avg, exp_avg_sq)")
    return f"world sizes {list(world_sizes)}, {STEPS} steps as unsharded AdamW with 1/n of its " \
           f"state per rank"
