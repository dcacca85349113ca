"""Expert parallelism: the experts of a :class:`~course_lib.ep.moe.MoE` split over the
ranks of a group, tokens sent to their experts' ranks with an all-to-all (Lab 07).

Rank r of n holds experts r E/n .. (r+1) E/n - 1 and a copy of the router, and feeds
the layer its own tokens. A step of the layer, for this rank's T_r tokens:

1. route: top-k experts and gates per token, as the dense layer does;
2. dispatch: sort the T_r k assignments by expert, then by choice j (token order kept
   within one), so they are grouped by owner, within an owner by expert, within an
   expert by choice; sum the token counts and the first choices over the group (one
   all-reduce: the capacity and the aux loss need them), exchange the count of rows for
   each (expert, choice) (an all-to-all of k E/n integers per peer), then all-to-all the
   token rows. No expert id travels with a row: the owner receives them by source rank,
   then by expert and choice, and the counts say where each run of rows starts;
3. the owner orders each expert's rows as the dense layer serves them over all ranks'
   tokens concatenated, first choices first (choice j, then source rank, then token),
   applies the capacity, runs its experts; dropped rows return as zeros;
4. combine: all-to-all the results back (the inverse of the dispatch), weigh each by its
   gate and add it to its token.

Both all-to-alls are differentiable (their backward is the all-to-all the other way).
Each rank returns its share of Switch's aux loss, E sum_e f_e P_e with f_e counted over
all ranks' tokens and P_e's sum over this rank's tokens: the shares add up to the dense
layer's aux, and so do their gradients::

    ep = ExpertParallelMoE.from_dense(moe, group=ep_group)
    out, aux_share = ep(my_tokens)

On a traced rank a step shows as spans "dispatch" (comm), "expert E" (compute, one per
local expert that keeps rows, E its global id, its rows in ``args``) and "combine"
(comm); backward as "combine backward", "expert E backward" and "dispatch backward". A
rank whose experts keep more rows computes longer, and the others wait for it inside
"combine" (and in backward inside "dispatch backward").
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib import trace
from course_lib.collectives.all_to_all import all_to_all
from course_lib.ep.moe import capacity
from course_lib.tp.regions import compute_region


class AllToAll(torch.autograd.Function):
    """Rows ``x`` cut by ``send`` to the peers, ``recv`` rows back from each; backward
    sends the gradients the other way, traced as "``label`` backward"."""

    @staticmethod
    def forward(ctx, x, recv, send, group, label="all_to_all", exchange=all_to_all,
                anchor=None):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        ctx.label, ctx.exchange = label, exchange
        out = x.new_empty((sum(recv), *x.shape[1:]))
        exchange(out, x.contiguous(), recv, send, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        with trace.span(f"{ctx.label} backward", "comm"):
            ctx.exchange(back, grad.contiguous(), ctx.send, ctx.recv, ctx.group)
        return back, None, None, None, None, None, None


def _run_expert(expert, rows, name):
    """``expert(rows)`` as a compute region (:func:`~course_lib.tp.regions.compute_region`):
    spans ``name`` and "``name`` backward" on a traced rank, carrying the rows. Autograd's
    CPU engine usually runs one expert's backward through before the next, so the span
    holds that expert alone; the engine promises no order, so read them as approximate."""
    return compute_region(name, expert, rows, rows=rows.shape[0])


def _summed(values, group):
    """``values`` (a tensor that needs no gradient) summed over ``group``."""
    values = values.clone()
    dist.all_reduce(values, group=group)
    return values


class ExpertParallelMoE(nn.Module):
    """A :class:`~course_lib.ep.moe.MoE` whose experts are split over ``group``."""

    @classmethod
    def from_dense(cls, moe, group=None, all_to_all=all_to_all):
        """The experts of ``moe`` that this rank holds, and a copy of its router;
        ``all_to_all(output, input, output_splits, input_splits, group)`` moves every
        count and row (Lab 07 passes the student's from Exercise 7.1)."""
        n, r = dist.get_world_size(group), dist.get_rank(group)
        if moe.n_experts % n:
            raise ValueError(f"{moe.n_experts} experts do not split over {n} ranks")
        layer = cls()
        layer.group, layer.n_ranks, layer.exchange = group, n, all_to_all
        layer.n_experts, layer.top_k = moe.n_experts, moe.top_k
        layer.capacity_factor, layer.per_rank = moe.capacity_factor, moe.n_experts // n
        layer.first = r * layer.per_rank  # this rank's first expert
        layer.router = copy.deepcopy(moe.router)
        layer.experts = nn.ModuleList(copy.deepcopy(moe.experts[e]) for e in
                                      range(layer.first, layer.first + layer.per_rank))
        return layer

    def forward(self, tokens):
        group, n, k, m = self.group, self.n_ranks, self.top_k, self.per_rank
        probs = F.softmax(self.router(tokens), dim=-1)
        gates, chosen = probs.topk(k, dim=-1)
        # assignments (token-major, a = t k + j) sorted by (expert, choice): grouped by
        # owner, then by expert, then by choice
        run_of = chosen * k + torch.arange(k, device=chosen.device)  # expert e, choice j: e k + j
        order = torch.sort(run_of.reshape(-1), stable=True).indices
        token_of = order // k
        outgoing = tokens[token_of]
        per_peer = m * k  # (expert, choice) runs each peer owns
        with trace.span("dispatch", "comm"):
            # first choices (for the aux loss) and tokens, over all ranks: one all-reduce
            firsts = torch.bincount(chosen[:, 0], minlength=self.n_experts)
            summed = _summed(torch.cat([firsts, firsts.new_tensor([tokens.shape[0]])]), group)
            # rows per (expert, choice); peer p's piece: its experts' runs, p m k .. p m k + m k - 1
            mine = torch.bincount(run_of.reshape(-1), minlength=self.n_experts * k)
            theirs = torch.empty_like(mine)
            self.exchange(theirs, mine, [per_peer] * n, [per_peer] * n, group)
            # one read of all three: on a GPU every read waits for the device
            numbers = torch.cat([mine, theirs, summed[-1:]]).tolist()
            total = numbers.pop()
            sent = [numbers[p * per_peer:(p + 1) * per_peer] for p in range(n)]
            got = [numbers[(n + p) * per_peer:(n + p + 1) * per_peer] for p in range(n)]
            send, recv = [sum(row) for row in sent], [sum(row) for row in got]
            rows = AllToAll.apply(outgoing, recv, send, group, "dispatch", self.exchange)
        cap = capacity(total, k, self.n_experts, self.capacity_factor)
        # rows came by source rank, then by (expert, choice): a stable sort by (expert,
        # choice, source rank) puts each expert's rows in the dense layer's queue order,
        # first choices first, and within a choice by rank then token
        regroup = None
        if rows.shape[0] and (n > 1 or k > 1 or m > 1):
            local, choice, source = torch.meshgrid(
                torch.arange(m, device=rows.device), torch.arange(k, device=rows.device),
                torch.arange(n, device=rows.device), indexing="ij")
            queue = (local * k * n + choice * n + source).permute(2, 0, 1).reshape(-1)
            place = torch.repeat_interleave(queue, theirs, output_size=rows.shape[0])
            regroup = torch.sort(place, stable=True).indices
            rows = rows[regroup]
        pieces, at, ran = [], 0, False
        for local, expert in enumerate(self.experts):
            arrived = sum(got[p][local * k + j] for p in range(n) for j in range(k))
            kept = min(cap, arrived)
            if kept:
                ran = True
                pieces.append(_run_expert(expert, rows[at:at + kept],
                                          f"expert {self.first + local}"))
            if arrived > kept:  # over capacity: these rows go back as zeros
                pieces.append(rows.new_zeros((arrived - kept, *rows.shape[1:])))
            at += arrived
        results = torch.cat(pieces) if pieces else torch.zeros_like(rows)
        if not ran and rows.requires_grad:
            # no expert here kept a row: the dispatch's backward still runs on every rank
            # (a rank missing from an exchange leaves its peers waiting), so keep the rows
            # in the graph, with a zero gradient
            results = results + 0 * rows
        if regroup is not None:  # each result back where its row arrived
            results = torch.zeros_like(results).index_copy(0, regroup, results)
        with trace.span("combine", "comm"):
            # the anchor makes the combine's backward run on every rank, also where no
            # gradient flows into it (no expert here kept a row, and tokens need none)
            anchor = results.new_zeros(0).requires_grad_(torch.is_grad_enabled())
            back = AllToAll.apply(results, send, recv, group, "combine", self.exchange, anchor)
        weighted = gates.reshape(-1)[order].unsqueeze(-1) * back
        out = torch.zeros_like(tokens).index_add(0, token_of, weighted)
        first = summed[:-1].to(probs.dtype)
        aux_share = self.n_experts * (first / total * probs.sum(0) / total).sum()
        return out, aux_share
