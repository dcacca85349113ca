"""Loss scaling for fp16 (Lab 03, section 9): a fixed scale, and the dynamic scaler
that ``torch.amp.GradScaler`` implements.

fp16 keeps 5 exponent bits: its smallest normal number is 2^-14 and its largest
65504. Below 2^-14 come the subnormals, spaced 2^-24 apart, which keep fewer digits the
smaller they are; at half of 2^-24 (about 3e-8) or less a value rounds to zero. Many
gradients of a deep network are that small: they lose their digits or vanish. Multiplying
the loss by S multiplies every gradient of backward by S (the chain rule is linear),
lifting them into range; the optimizer must then see grad / S. Too large an S
overflows to inf (or nan), which poisons the weights if the step is taken. The
dynamic scaler finds the largest S that does not overflow, and follows it as it
drifts:

- on a step whose gradients hold an inf or a nan: skip the optimizer step,
  S <- S x backoff (0.5), restart the count of clean steps;
- after ``growth_interval`` clean steps in a row: S <- S x growth (2), restart the count.

Both classes have GradScaler's methods, so :func:`fp16_run` trains with any of them::

    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=2000)
    scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _grads(optimizer):
    return [p.grad for group in optimizer.param_groups for p in group["params"]
            if p.grad is not None]


class StaticLossScaler:
    """The naive version: one fixed scale S. Skips a step that overflows (so the
    weights survive), but never adapts: too small a scale lets gradients underflow,
    too large a one skips every step."""

    def __init__(self, scale=2.0**16):
        self._scale = float(scale)
        self._found_inf = False

    def scale(self, loss):
        return loss * self._scale

    def step(self, optimizer):
        grads = _grads(optimizer)
        inverse = 1.0 / self._scale
        for g in grads:
            g.mul_(inverse)
        # one bad element anywhere means S x grad left fp16's range: the whole step is suspect
        self._found_inf = not all(torch.isfinite(g).all() for g in grads)
        if not self._found_inf:
            optimizer.step()

    def update(self):
        pass

    def get_scale(self):
        return self._scale


class DynamicLossScaler(StaticLossScaler):
    """The scale that backs off on overflow and grows after ``growth_interval`` clean
    steps: torch's ``GradScaler`` semantics (unscale in ``step``, adjust in
    ``update``), without its per-device bookkeeping."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1, "
                             "growth_interval >= 1")
        super().__init__(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._clean_steps = 0

    def update(self):
        if self._found_inf:
            self._scale *= self.backoff_factor
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self._scale *= self.growth_factor
            self._clean_steps = 0


def overflow_model(seed=0, width=24):
    """A small MLP (fp32 weights) whose fp16 backward overflows at scales above about
    2^10 on the batches of :func:`overflow_batch` (inputs and targets of size ~40):
    the run to test a scaler on."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    layers = []
    for fan_in, fan_out in ((8, width), (width, width), (width, 4)):
        linear = torch.nn.Linear(fan_in, fan_out)
        with torch.no_grad():
            weight = torch.randn(fan_out, fan_in, generator=gen, device="cpu")
            linear.weight.copy_(weight / fan_in ** 0.5)
            linear.bias.zero_()
        layers += [linear, torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def overflow_batch(step, seed=0, rows=16, magnitude=40.0):
    gen = torch.Generator(device="cpu").manual_seed(seed * 1000 + step)
    return (torch.randn(rows, 8, generator=gen, device="cpu") * magnitude,
            torch.randn(rows, 4, generator=gen, device="cpu") * magnitude)


def fp16_run(scaler, steps=24, seed=0, lr=1e-3, device="cpu"):
    """Train :func:`overflow_model` for ``steps`` SGD steps with fp16 autocast and
    ``scaler`` (anything with ``scale``, ``step``, ``update``, ``get_scale``).
    Returns plain lists: the scale after each ``update``, whether each step changed
    the weights, the fp32 loss of each step, what ``scale`` multiplied it by, and the
    final weights."""
    model = overflow_model(seed).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scales, stepped, losses, multiplied = [], [], [], []
    for step in range(steps):
        x, y = (t.to(device) for t in overflow_batch(step, seed))
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=torch.float16):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        before = [p.detach().clone() for p in model.parameters()]
        scaled = scaler.scale(loss)
        multiplied.append(float(scaled.detach() / loss.detach()))
        scaled.backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        stepped.append(any(not torch.equal(b, p.detach())
                           for b, p in zip(before, model.parameters())))
        losses.append(loss.item())
    return {"scales": scales, "stepped": stepped, "losses": losses, "multiplied": multiplied,
            "params": [p.detach().cpu().clone() for p in model.parameters()]}


def grad_scaler(device="cpu", **settings):
    """torch's own dynamic scaler with the same settings: the reference."""
    return torch.amp.GradScaler(torch.device(device).type, **settings)
