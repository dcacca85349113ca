"""The course GPT trained with tensor-parallel blocks, step for step beside the dense GPT.

Any block class that is a drop-in for the GPT's ``Block`` (built as
``block_class(dense_block, group)``, called as ``block(x)`` on (b, s, h)) replaces
every block on each rank of the tensor-parallel group; the embeddings, the final
LayerNorm and the head stay whole on every rank. Inside each block f and g make
every rank's activations, and so its loss, the dense ones: trained with AdamW on
the same corpus windows, the tensor-parallel GPT follows the dense GPT trained in
one process, loss for loss and weight slice for weight slice::

    tp = run(train_gpt, cfg, block_class=ParallelBlock, nproc=2)[0]   # on the ranks
    dense = train_gpt(cfg)                                            # one process
    print(loss_table(dense["losses"], tp["losses"]))

``distinct=True`` gives every parameter values of its own (LayerNorm weights near
1, biases near 0, but no two alike), so that a slice can be told apart by its
values alone: Lab 05's check finds each of the student's parameters, whatever its
name, among the slices of the dense GPT's.
"""
from __future__ import annotations

import torch

from course_lib.models import GPT, param_seed
from course_lib.pipeline.runs import corpus_batches, corpus_config, gpt_loss
from course_lib.runtime.backend import current_device

__all__ = ["LR", "gpt_config", "distinct_init", "build_gpt", "train_gpt", "loss_table"]

LR = 3e-3


def gpt_config(dim=12, heads=6, layers=2, seq_len=8):
    """A small GPT on the course corpus. 6 heads split over 1, 2, 3 or 6 ranks, and the
    MLP's hidden width 4 * dim over as many."""
    return corpus_config(layers=layers, dim=dim, heads=heads, seq_len=seq_len)


@torch.no_grad()
def distinct_init(model, seed):
    """Move every 1-D parameter (LayerNorm weights, biases) off its constant start by a
    small draw of its own generator (seeded by name), so that no two parameters, and
    no two slices of one, are equal. The 2-D weights are random already."""
    for name, p in model.named_parameters():
        if p.dim() == 1:
            gen = torch.Generator(device="cpu").manual_seed(param_seed(f"distinct:{name}", seed))
            p.add_((0.1 * torch.randn(p.shape, generator=gen, device="cpu")).to(p.device))
    return model


def build_gpt(cfg, block_class=None, group=None, seed=0, distinct=False):
    """The course GPT with every block replaced by ``block_class(block, group)`` (None: dense),
    on this rank's device."""
    model = GPT(cfg, seed)
    if distinct:
        distinct_init(model, seed)
    if block_class is not None:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = block_class(block, group)
    return model.to(current_device())


def _state(model):
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def train_gpt(cfg, block_class=None, group=None, steps=3, batch=4, seed=0, lr=LR,
              distinct=False, keep_state=False):
    """``steps`` AdamW steps on the corpus (the same windows on every rank and in one
    process). Returns {"losses": [float per step]}, and with ``keep_state`` this rank's
    parameters "before" and "after" training (name -> CPU tensor)."""
    model = build_gpt(cfg, block_class, group, seed, distinct)
    before = _state(model) if keep_state else None
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn, losses = gpt_loss(cfg.vocab), []
    for x, y in corpus_batches(cfg, batch, steps, current_device()):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if not keep_state:
        return {"losses": losses}
    return {"losses": losses, "before": before, "after": _state(model)}


def loss_table(dense, parallel, label="tensor parallel"):
    """The two runs' loss per step side by side, with their difference."""
    lines = [f"{'step':>4}  {'dense':>10}  {label:>16}  {'difference':>10}"]
    for step, (a, b) in enumerate(zip(dense, parallel), start=1):
        lines.append(f"{step:>4}  {a:>10.6f}  {b:>16.6f}  {abs(a - b):>10.1e}")
    return "\n".join(lines)
