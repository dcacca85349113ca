"""A mixture-of-experts layer in one process: the reference expert parallelism must
equal (Lab 07).

A router scores every token against the E experts; each token goes to its top-k
experts, weighted by the router's probability of each (Switch's gates, not
renormalised over the k). Expert e takes at most C = ceil(capacity_factor x T x k / E)
of the T x k assignments, first choices first, as GShard's and DeepSpeed-MoE's top-2
gating do: every token's first choice in token order, then every second choice, and so
on (served token by token instead, token t's second choice could take the last slot
ahead of token t + 1's first). The rest are dropped, and a token dropped by all its
experts passes through the layer as zero (the residual around the layer carries it).
The load-balancing loss of Switch Transformer:

    aux = E x sum_e f_e P_e,   f_e: the share of tokens whose first choice is e,
                               P_e: the mean router probability of e

is 1 when loads and probabilities are uniform, but that is not its minimum (E = 2,
f = (0.9, 0.1), P = (0.45, 0.55) gives 0.92): f is a count, without a gradient, and
through P the loss moves probability away from the most loaded experts::

    moe = MoE(d_model=16, d_ff=32, n_experts=4, top_k=2)
    out, aux = moe(tokens)           # tokens (T, d_model) -> out (T, d_model)
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    """One feed-forward expert: d_model -> d_ff -> d_model."""

    def __init__(self, d_model, d_ff):
        super().__init__()
        self.up, self.down = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def capacity(n_tokens, top_k, n_experts, capacity_factor):
    """C = ceil(capacity_factor x T x k / E): the assignments one expert may take."""
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def kept_assignments(chosen, n_experts, cap):
    """(T, k) bool: which of the token-by-choice assignments ``chosen`` (T, k) fit in
    their expert's capacity ``cap``, served first choices first: (j, t) in the order
    j T + t, every token's choice j before any token's choice j + 1.

        chosen = [[1, 0], [0, 1]], cap = 1  ->  [[True, False], [True, False]]
        (token 0's second choice, expert 0, waits behind token 1's first)"""
    by_choice = chosen.t().reshape(-1)  # j-major: position j T + t
    one_hot = F.one_hot(by_choice, n_experts)
    place = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # 0-based place in its expert's queue
    return (place < cap).reshape(chosen.shape[1], chosen.shape[0]).t()


def balance_loss(probs, chosen, n_experts):
    """Switch's aux loss E x sum_e f_e P_e on a (T, E) probability table."""
    f = torch.bincount(chosen[:, 0], minlength=n_experts).to(probs.dtype) / probs.shape[0]
    return n_experts * (f * probs.mean(0)).sum()


class MoE(nn.Module):
    """Router, top-k gating with a capacity per expert, the experts, and the aux loss;
    ``forward(tokens (T, d_model))`` returns (output (T, d_model), aux)."""

    def __init__(self, d_model, d_ff, n_experts, top_k=1, capacity_factor=1.25, seed=0):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, {n_experts}], got {top_k}")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.router = nn.Linear(d_model, n_experts, bias=False)
            self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(n_experts))

    def route(self, tokens):
        """(probs (T, E), gates (T, k), chosen (T, k), kept (T, k))."""
        probs = F.softmax(self.router(tokens), dim=-1)
        gates, chosen = probs.topk(self.top_k, dim=-1)
        cap = capacity(tokens.shape[0], self.top_k, self.n_experts, self.capacity_factor)
        return probs, gates, chosen, kept_assignments(chosen, self.n_experts, cap)

    def forward(self, tokens):
        probs, gates, chosen, kept = self.route(tokens)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero((chosen == e) & kept, as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, gates[token, slot].unsqueeze(-1)
                                    * expert(tokens[token]))
        return out, balance_loss(probs, chosen, self.n_experts)
