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

from course_lib.collectives.select import collective_ops
from course_lib.ep import ExpertParallelMoE, MoE
from course_lib.hybrid.strategies import LR, Strategy, train_strategy
from course_lib.mesh import ParallelDims
from course_lib.models import Block, GPTConfig, gpt_param_count, init_deterministic
from course_lib.pipeline.runs import corpus_batches, gpt_loss
from course_lib.runtime.backend import current_device

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


def moe_params(cfg: GPTConfig, n_experts=4):
    """(shared, experts): the parameters of :class:`MoEGPT` outside its experts (the dense
    GPT's, less each block's MLP of 8D^2 + 5D, plus each router's D E) and in them
    (L E (8D^2 + 5D)). A rank of ep = n holds shared + experts / n."""
    d, mlp = cfg.dim, 8 * cfg.dim * cfg.dim + 5 * cfg.dim
    return gpt_param_count(cfg) - cfg.layers * (mlp - d * n_experts), cfg.layers * n_experts * mlp


def moe_strategy(name, cfg, dp, inner, seed, lr, n_experts=4, top_k=2, capacity_factor=1.25,
                 **_):
    """The strategy table's MoE rows, on n = dp x inner ranks, each taking B/n rows:

    - ``moe_dp``: every rank holds all E experts and averages every gradient (one
      all-reduce of them all); capacity and the balancing loss count its own rows only,
      as plain DDP over an MoE model does;
    - ``moe_dp_ep``: ep = n, E/n experts per rank, as :func:`train_dp_ep` (equal to one
      process on the whole batch): the replicated weights' gradients all-reduced, the
      experts' only divided by n."""
    n = dp * inner
    if n_experts % n and name == "moe_dp_ep":
        raise ValueError(f"ep = {n} ranks must divide the {n_experts} experts")
    dims = ParallelDims(dp=n).build()
    group, all_reduce = dims.group("dp"), collective_ops("torch").all_reduce
    model = MoEGPT(cfg, n_experts, top_k, capacity_factor, seed)
    held = expert_parallel(model, group) if name == "moe_dp_ep" else {}
    model = model.to(current_device())
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn = gpt_loss(cfg.vocab)
    # with ep, a rank's aux is its share of the whole batch's: the shares add up to it
    aux_scale = n if held else 1

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        logits, aux = model(run.rows(x))
        ce = loss_fn(logits, run.rows(y))
        (ce + AUX_WEIGHT * aux_scale * aux).backward()
        params = list(model.parameters())
        for p in params:
            if p.grad is None:  # an expert no token reached this step
                p.grad = torch.zeros_like(p)
        shared = [p for p in params if id(p) not in held]
        flat = torch.cat([p.grad.reshape(-1) for p in shared])
        all_reduce(flat, group=group)  # one call: the replicated weights' gradients summed
        for p, g in zip(shared, flat.split([p.numel() for p in shared])):
            p.grad.copy_(g.view_as(p))
        for p in params:
            p.grad /= n
        opt.step()
        reported = (ce.detach() + AUX_WEIGHT * aux_scale * aux.detach()).reshape(1) / n
        dist.all_reduce(reported, group=group)
        return reported.item()

    def full_state():
        mine = {held.get(id(p), k): p.detach().cpu().clone() for k, p in model.named_parameters()}
        every = [None] * n
        dist.all_gather_object(every, mine, group=group)
        return {k: t for part in every for k, t in part.items()}

    run = Strategy(name, dims, model, opt, step, full_state, (dims.coords.dp, n))
    return run


def train_dp_ep(cfg, n_experts=4, top_k=2, steps=3, batch=8, seed=0, lr=LR,
                capacity_factor=1.25):
    """On every rank of the world (dp = ep = world size): train :class:`MoEGPT` as the
    module's docstring lays out. Returns {"losses", "state"}: the whole batch's loss
    on every rank; the full state (every expert gathered) on rank 0, None elsewhere."""
    dp = dist.get_world_size()
    if n_experts % dp or batch % dp:
        raise ValueError(f"dp = ep = {dp} must divide the {n_experts} experts and the "
                         f"batch of {batch}")
    out = train_strategy("moe_dp_ep", cfg, steps=steps, batch=batch, dp=dp, inner=1, seed=seed,
                         lr=lr, n_experts=n_experts, top_k=top_k, capacity_factor=capacity_factor)
    return {"losses": out["losses"], "state": out["state"]}


__all__ = ["MoEGPT", "MoEBlock", "AUX_WEIGHT", "reference_moe_training", "train_dp_ep",
           "expert_parallel", "moe_strategy", "moe_params"]
