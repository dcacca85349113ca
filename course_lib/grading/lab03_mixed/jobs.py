"""What the checks of Lab 03's mixed-precision exercises run in the student's process:
the student's master weights (3.9) and loss scaler (3.10) on deterministic runs,
reported as plain facts. Nothing here compares: the checks do, with references of
their own."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib.memory.loss_scaling import fp16_run
from course_lib.memory.measure import _storages, model_state_bytes_of
from course_lib.models import deep_mlp

# (seed, lr, steps): first a learning rate under half a bf16 step of most weights (~0.01)
MASTER_CASES = [(0, 1e-5, 6), (1, 1e-2, 4)]


def master_batch(seed):
    gen = torch.Generator(device="cpu").manual_seed(100 + seed)
    return (torch.randn(16, 11, generator=gen, device="cpu"),
            torch.randn(16, 3, generator=gen, device="cpu"))


def master_model(seed):
    return deep_mlp(13, 2, inputs=11, outputs=3, seed=seed).to(torch.bfloat16)


def train_with_master(master_cls, seed, lr, steps):
    """Train :func:`master_model` (bf16) with ``master_cls(params, make_optimizer)``
    and AdamW; the optimizers it made, the model, and the bytes after the last step."""
    model = master_model(seed)
    made = []

    def make_optimizer(params):
        made.append(torch.optim.AdamW(params, lr=lr))
        return made[-1]

    master = master_cls(model.parameters(), make_optimizer)
    x, y = master_batch(seed)
    for _ in range(steps):
        master.zero_grad()
        F.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()
        master.step()
    sizes = None  # what the state holds after the last step (between two steps)
    if made:
        state = model_state_bytes_of(model, made[0])
        masters = [p for g in made[0].param_groups for p in g["params"]]
        sizes = {**state, "master": _storages(masters),
                 "master_grads": _storages(p.grad for p in masters)}
    return made, model, sizes


def master_facts(master_cls, cases=MASTER_CASES):
    """Exercise 3.9: for each (seed, lr, steps), what training with the student's class
    left: the optimizers made, the dtype of what they step, the masters, the bf16
    weights, and the bytes of each kind of state after the last step."""
    out = []
    for seed, lr, steps in cases:
        made, model, sizes = train_with_master(master_cls, seed, lr, steps)
        masters = [p for g in made[0].param_groups for p in g["params"]] if made else []
        out.append({
            "optimizers": len(made),
            "master_dtypes": sorted({str(m.dtype) for m in masters}),
            "masters": [m.detach().clone().as_subclass(torch.Tensor) for m in masters],
            "params": [p.detach().float().clone() for p in model.parameters()],
            "bytes": sizes,
            "numel": sum(p.numel() for p in model.parameters())})
    return out


# GradScaler's settings for each run: from the default start, from too small a scale,
# and with other factors and a short interval
SCALER_SETTINGS = [dict(init_scale=2.0**16, growth_interval=4),
                   dict(init_scale=2.0**6, growth_interval=3),
                   dict(init_scale=2.0**20, growth_factor=4.0, backoff_factor=0.25,
                        growth_interval=2)]
SCALER_STEPS = 24


def scaler_facts(scaler_cls, settings=SCALER_SETTINGS, steps=SCALER_STEPS):
    """Exercise 3.10: :func:`~course_lib.memory.loss_scaling.fp16_run` with the
    student's scaler built with each of ``settings``."""
    return [fp16_run(scaler_cls(**s), steps=steps) for s in settings]
