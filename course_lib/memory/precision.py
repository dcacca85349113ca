"""Mixed precision: what each recipe keeps per parameter, and fp32 master weights for a
model held in bf16 (Lab 03, section 9).

Four recipes for training with AdamW, in bytes per parameter of model state
(weights + gradients + optimizer state + master copy), the quantity ZeRO shards:

=================  =======  =====  =========  ======  =====
recipe             weights  grads  AdamW m,v  master  total
=================  =======  =====  =========  ======  =====
``fp32``           4        4      4 + 4      -       16
``autocast_bf16``  4        4      4 + 4      -       16
``bf16_master``    2        2      4 + 4      4       16
``pure_bf16``      2        2      2 + 2      -       8
=================  =======  =====  =========  ======  =====

Autocast changes the *compute*, not the state: the matmuls of forward and backward run
in bf16 on copies cast on the fly (freed after the step), while the parameters,
their gradients and the moments stay fp32, which is why it saves activation memory and
time but not a byte of the 16P. The lecture's 16P is ``bf16_master``: the weights
live in bf16, and an fp32 *master* copy takes the update, because an update smaller
than half a bf16 unit in the last place of a weight (between 2^-9 and 2^-8 of it:
bf16 keeps 8 significant bits) is rounded away in bf16. ``pure_bf16`` halves the state and loses
exactly those updates.

    master = FP32Master(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    loss.backward(); master.step(); master.zero_grad()
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib.memory.measure import _storages, model_state_bytes_of

RECIPES = ("fp32", "autocast_bf16", "bf16_master", "pure_bf16")
# (weights, gradients, AdamW's two moments, master copy): bytes per parameter
RECIPE_BYTES = {"fp32": (4, 4, 8, 0), "autocast_bf16": (4, 4, 8, 0),
                "bf16_master": (2, 2, 8, 4), "pure_bf16": (2, 2, 4, 0)}


def state_bytes_per_param(recipe):
    """Model-state bytes per parameter of ``recipe`` (the table above)."""
    if recipe not in RECIPE_BYTES:
        raise ValueError(f"unknown recipe {recipe!r}; one of {', '.join(RECIPES)}")
    return sum(RECIPE_BYTES[recipe])


class FP32Master:
    """fp32 master weights for parameters held in bf16 (or fp16).

    The optimizer (``make_optimizer(masters)``) owns fp32 copies of the parameters;
    :meth:`step` hands it the gradients in fp32, steps, copies the updated masters back
    into the 16-bit parameters (rounding once per step, never accumulating the
    rounding) and drops the fp32 gradients, so that between steps a parameter costs
    2 (weight) + 2 (gradient) + 4 (master) + 8 (AdamW) = 16 bytes."""

    def __init__(self, params, make_optimizer):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.optimizer = make_optimizer(self.masters)

    def step(self):
        for param, master in zip(self.params, self.masters):
            master.grad = None if param.grad is None else param.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                param.copy_(master)
                master.grad = None  # 4 bytes a parameter that nobody needs until next step

    def zero_grad(self):
        for param in self.params:
            param.grad = None


def measure_recipe(recipe, make_model, batch, master_cls=FP32Master, lr=1e-3):
    """Train ``make_model()`` one AdamW step under ``recipe`` on ``batch`` =
    (tokens, targets); the model state it holds afterwards, in bytes:
    {"params", "grads", "optimizer", "master", "total"}. ``master_cls`` builds the
    master copy of ``bf16_master`` (the student's class, in the lab)."""
    state_bytes_per_param(recipe)  # refuses an unknown recipe
    model = make_model()
    if recipe in ("bf16_master", "pure_bf16"):
        model = model.to(torch.bfloat16)
    x, y = batch
    master = None
    if recipe == "bf16_master":
        master = master_cls(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=lr))
        optimizer = master.optimizer
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=recipe == "autocast_bf16"):
        logits = model(x)
    F.cross_entropy(logits.float().flatten(0, -2), y.flatten()).backward()
    (master or optimizer).step()
    measured = model_state_bytes_of(model, optimizer)
    # the masters are the optimizer's parameters, not the model's: counted apart
    measured["master"] = _storages(master.masters) if master else 0
    measured["total"] += measured["master"]
    return measured
