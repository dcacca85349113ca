"""Expert parallelism: the experts of a :class:`~course_lib.ep.moe.MoE` split over the
ranks of a group, tokens sent to their experts' ranks with an all-to-all (Lab 07).

Rank r of n holds experts r E/n .. (r+1) E/n - 1 and a copy of the router, and feeds
the layer its own tokens. A step of the layer, for this rank's T_r tokens:

1. route: top-k experts and gates per token, as the dense layer does;
2. dispatch: sort the T_r k assignments by expert (token order kept within one), count
   the rows for each rank, exchange the counts, then all-to-all the token rows (and
   their expert ids);
3. the owner applies each expert's capacity to the rows it received, in rank order then
   token order, which is the dense layer's order over all ranks' tokens concatenated;
   runs its experts; dropped rows return as zeros;
4. combine: all-to-all the results back (the inverse of the dispatch), weigh each by its
   gate and add it to its token.

Both all-to-alls are differentiable (their backward is the all-to-all the other way).
Each rank returns its share of Switch's aux loss, E sum_e f_e P_e with f_e counted over
all ranks' tokens and P_e's sum over this rank's tokens: the shares add up to the dense
layer's aux, and so do their gradients::

    ep = ExpertParallelMoE.from_dense(moe, group=ep_group)
    out, aux_share = ep(my_tokens)
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.collectives.all_to_all import all_to_all
from course_lib.ep.moe import capacity


class AllToAll(torch.autograd.Function):
    """Rows ``x`` cut by ``send`` to the peers, ``recv`` rows back from each; backward
    sends the gradients the other way."""

    @staticmethod
    def forward(ctx, x, recv, send, group):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        all_to_all(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        all_to_all(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def _summed(values, group):
    """``values`` (a tensor that needs no gradient) summed over ``group``."""
    values = values.clone()
    dist.all_reduce(values, group=group)
    return values


class ExpertParallelMoE(nn.Module):
    """A :class:`~course_lib.ep.moe.MoE` whose experts are split over ``group``."""

    @classmethod
    def from_dense(cls, moe, group=None):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        if moe.n_experts % n:
            raise ValueError(f"{moe.n_experts} experts do not split over {n} ranks")
        layer = cls()
        layer.group, layer.n_ranks = group, n
        layer.n_experts, layer.top_k = moe.n_experts, moe.top_k
        layer.capacity_factor, layer.per_rank = moe.capacity_factor, moe.n_experts // n
        layer.first = r * layer.per_rank  # this rank's first expert
        layer.router = copy.deepcopy(moe.router)
        layer.experts = nn.ModuleList(copy.deepcopy(moe.experts[e]) for e in
                                      range(layer.first, layer.first + layer.per_rank))
        return layer

    def forward(self, tokens):
        group, n, k = self.group, self.n_ranks, self.top_k
        probs = F.softmax(self.router(tokens), dim=-1)
        gates, chosen = probs.topk(k, dim=-1)
        total = int(_summed(torch.tensor([tokens.shape[0]], device=tokens.device), group))
        cap = capacity(total, k, self.n_experts, self.capacity_factor)
        # dispatch: assignments (token-major) sorted by expert, so grouped by owner too
        expert_of = chosen.reshape(-1)
        order = torch.sort(expert_of, stable=True).indices
        token_of = order // k
        send = torch.bincount(expert_of[order] // self.per_rank, minlength=n).tolist()
        counts = torch.tensor(send, device=tokens.device)
        arrived = torch.empty_like(counts)
        all_to_all(arrived, counts, group=group)
        recv = arrived.tolist()
        rows = AllToAll.apply(tokens[token_of], recv, send, group)
        ids = expert_of[order].new_empty(sum(recv))
        all_to_all(ids, expert_of[order].contiguous(), recv, send, group=group)
        # the owner keeps each expert's first `cap` rows: rank order, then token order
        results = torch.zeros_like(rows)
        for local, expert in enumerate(self.experts):
            mine = torch.nonzero(ids == self.first + local).squeeze(-1)[:cap]
            if mine.numel():
                results = results.index_add(0, mine, expert(rows[mine]))
        back = AllToAll.apply(results, send, recv, group)
        weighted = gates.reshape(-1)[order].unsqueeze(-1) * back
        out = torch.zeros_like(tokens).index_add(0, token_of, weighted)
        first = _summed(torch.bincount(chosen[:, 0], minlength=self.n_experts).to(probs.dtype),
                        group)
        aux_share = self.n_experts * (first / total * probs.sum(0) / total).sum()
        return out, aux_share
