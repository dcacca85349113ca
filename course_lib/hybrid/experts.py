"""Experts inside the mesh: a mixture-of-experts GPT with expert parallelism over the
data-parallel ranks, ep = dp (Lab 06, with Lab 07's layers).

:class:`MoEGPT` is the course GPT with every block's MLP replaced by a
:class:`~course_lib.ep.moe.MoE` (E experts, top-k, a capacity); its loss is the
cross-entropy plus ``aux_weight`` times the layers' load-balancing losses. One process
trains it on the whole batch; :func:`dp_ep_step` trains it on ``dp`` ranks:

- rank r takes rows r B/dp .. (r+1) B/dp - 1 of the batch and holds every weight but
  the experts, of which it holds E/dp (:class:`~course_lib.ep.ExpertParallelMoE`: its
  tokens go to their experts' ranks and back, capacity counted over all ranks' tokens,
  first choices first, as the dense layer counts it over the whole batch);
- its objective is l_r = CE_r + aux_weight dp sum_layers aux_r, aux_r its share of the
  dense layer's aux (the shares add up to it). The whole batch's objective is
  G = (1/dp) sum_r CE_r + aux_weight sum_layers aux, so
- a replicated weight's gradient is the mean over the ranks of grad l_r (an all-reduce
  over dp, as DDP does), and an expert's, which every rank's tokens reached through the
  all-to-all, is sum_r grad l_r on its own rank: divided by dp, and never all-reduced.

    out = run(train_dp_ep, cfg, n_experts=4, top_k=2, steps=3, batch=8, nproc=2)
    ref = reference_moe_training(cfg, n_experts=4, top_k=2, steps=3, batch=8)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.ep import ExpertParallelMoE, MoE
from course_lib.hybrid.strategies import LR
from course_lib.models import Block, GPTConfig, init_deterministic
from course_lib.pipeline.runs import corpus_batches, gpt_loss

AUX_WEIGHT = 0.01


class MoEBlock(nn.Module):
    """``x + attn(ln1(x))``, then ``+ moe(ln2(x))`` over the (B T) tokens; returns (x, aux)."""

    def __init__(self, block: Block, moe: MoE):
        super().__init__()
        self.ln1, self.attn, self.ln2 = block.ln1, block.attn, block.ln2
        self.moe = moe

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        out, aux = self.moe(self.ln2(x).reshape(-1, x.shape[-1]))
        return x + out.reshape(x.shape), aux


class MoEGPT(nn.Module):
    """The course GPT, its MLPs mixtures of ``n_experts`` experts of width 4D."""

    def __init__(self, cfg: GPTConfig, n_experts=4, top_k=2, capacity_factor=1.25, seed=0):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(
            MoEBlock(Block(cfg), MoE(cfg.dim, 4 * cfg.dim, n_experts, top_k, capacity_factor))
            for _ in range(cfg.layers))
        self.ln_f, self.head = nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, cfg.vocab)
        init_deterministic(self, seed)  # every weight from its name: the same on every rank

    def forward(self, tokens):  # (B, T) -> (logits (B, T, V), the layers' aux summed)
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        aux = x.new_zeros(())
        for block in self.blocks:
            x, layer_aux = block(x)
            aux = aux + layer_aux
        return self.head(self.ln_f(x)), aux


def reference_moe_training(cfg, n_experts=4, top_k=2, steps=3, batch=8, seed=0, lr=LR,
                           capacity_factor=1.25):
    """One process, the whole batch: {"losses", "state"} (loss = CE + AUX_WEIGHT aux)."""
    model = MoEGPT(cfg, n_experts, top_k, capacity_factor, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x, y in corpus_batches(cfg, batch, steps, "cpu"):
        opt.zero_grad(set_to_none=True)
        logits, aux = model(x)
        loss = gpt_loss(cfg.vocab)(logits, y) + AUX_WEIGHT * aux
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {n: p.detach().clone() for n, p in model.named_parameters()}}


def expert_parallel(model, group=None):
    """``model``'s MoE layers split over ``group`` (in place); the names of the expert
    parameters this rank now holds, as the dense model names them."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    held = {}
    for i, block in enumerate(model.blocks):
        per = block.moe.n_experts // n
        block.moe = ExpertParallelMoE.from_dense(block.moe, group=group)
        for local, expert in enumerate(block.moe.experts):
            for name, p in expert.named_parameters():
                held[id(p)] = f"blocks.{i}.moe.experts.{r * per + local}.{name}"
    return held


def train_dp_ep(cfg, n_experts=4, top_k=2, steps=3, batch=8, seed=0, lr=LR,
                capacity_factor=1.25):
    """On every rank of the world (dp = ep = world size): train :class:`MoEGPT` as the
    module's docstring lays out. Returns {"losses", "state"}: the whole batch's loss
    on every rank; the full state (every expert gathered) on rank 0, None elsewhere."""
    from course_lib.runtime.backend import current_device

    dp, rank, device = dist.get_world_size(), dist.get_rank(), current_device()
    if n_experts % dp or batch % dp:
        raise ValueError(f"dp = ep = {dp} must divide the {n_experts} experts and the "
                         f"batch of {batch}")
    model = MoEGPT(cfg, n_experts, top_k, capacity_factor, seed)
    held = expert_parallel(model)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rows = slice(rank * batch // dp, (rank + 1) * batch // dp)
    losses = []
    for x, y in corpus_batches(cfg, batch, steps, device):
        opt.zero_grad(set_to_none=True)
        logits, aux_share = model(x[rows])
        ce = gpt_loss(cfg.vocab)(logits, y[rows])
        (ce + AUX_WEIGHT * dp * aux_share).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if id(p) not in held:  # replicated: the ranks' mean
                dist.all_reduce(p.grad)
            p.grad /= dp
        opt.step()
        reported = (ce.detach() / dp + AUX_WEIGHT * aux_share.detach()).reshape(1)
        dist.all_reduce(reported)
        losses.append(reported.item())
    mine = {held.get(id(p), name): p.detach().cpu().clone() for name, p in model.named_parameters()}
    every = [None] * dp
    dist.all_gather_object(every, mine)
    state = {n: t for part in every for n, t in part.items()} if rank == 0 else None
    return {"losses": losses, "state": state}


__all__ = ["MoEGPT", "MoEBlock", "AUX_WEIGHT", "reference_moe_training", "train_dp_ep",
           "expert_parallel"]
