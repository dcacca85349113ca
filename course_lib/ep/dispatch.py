"""Token dispatch and combine, the bookkeeping around an MoE layer's experts (Lab 07,
Exercise 7.7), in one process.

A router picks ``chosen`` (T, k): token t's experts, best first. The assignments are
read token-major (a = t k + j). Dispatch sorts the kept ones by expert (token order
within an expert) so that each expert's rows, and each rank's, are contiguous:

- ``order``: the kept assignments' indices a, grouped by expert, increasing within an
  expert; an expert keeps ``capacity`` assignments, first choices first
  (:func:`~course_lib.ep.moe.kept_assignments`: every token's choice j before any
  token's choice j + 1);
- ``counts``: the rows for each rank, expert e living on rank e // (E / n).

Rows go out as ``tokens[order // k]``; the experts answer row for row; combine applies
the inverse permutation, adding row i, weighed by its gate, back to token order[i] // k
(a dropped assignment adds nothing)::

    order, counts = dispatch(chosen, n_experts=8, n_ranks=2, capacity=6)
    rows = run_experts(tokens[order // k])
    out = combine(rows, order, gates, n_tokens=T)
"""
from __future__ import annotations

import torch

from course_lib.ep.moe import capacity, kept_assignments


def dispatch(chosen, n_experts, n_ranks, capacity):
    """(order (kept assignments, by expert), counts (rows per rank, a list))."""
    if n_experts % n_ranks:
        raise ValueError(f"{n_experts} experts do not split over {n_ranks} ranks")
    flat = chosen.reshape(-1)
    kept = torch.nonzero(kept_assignments(chosen, n_experts, capacity).reshape(-1)).squeeze(-1)
    order = kept[torch.sort(flat[kept], stable=True).indices]
    owner = flat[order] // (n_experts // n_ranks)
    return order, torch.bincount(owner, minlength=n_ranks).tolist()


def combine(rows, order, gates, n_tokens):
    """Row i of ``rows`` (the experts' outputs in dispatch order) times its gate, added
    to its token: (n_tokens, d)."""
    k = gates.shape[-1]
    weighted = gates.reshape(-1)[order].unsqueeze(-1) * rows
    return rows.new_zeros((n_tokens, rows.shape[-1])).index_add(0, order // k, weighted)


def moe_forward(moe, tokens, dispatch=dispatch, combine=combine):
    """``moe``'s output on ``tokens`` (T, d) built from a ``dispatch`` and a ``combine``
    (the lab passes the student's): route, dispatch the rows, run each expert on its
    contiguous run of rows, combine. Equal to ``moe(tokens)[0]`` when both are right."""
    _, gates, chosen, _ = moe.route(tokens)
    cap = capacity(tokens.shape[0], moe.top_k, moe.n_experts, moe.capacity_factor)
    order, _ = dispatch(chosen, moe.n_experts, 1, cap)
    order = torch.as_tensor(order, dtype=torch.long)
    rows = tokens[order // moe.top_k]
    experts = chosen.reshape(-1)[order]
    answers = torch.zeros_like(rows)
    for e, expert in enumerate(moe.experts):
        mine = torch.nonzero(experts == e).squeeze(-1)
        if mine.numel():
            answers = answers.index_add(0, mine, expert(rows[mine]))
    return combine(answers, order, gates, tokens.shape[0])
