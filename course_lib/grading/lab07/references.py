"""What Lab 07's checks compare with, worked out in the checking process from the inputs
they chose, with plain loops and dense attention (never course_lib's all-to-all, ring
attention or dispatch, which are what the student rewrites).

- 7.1: the splits of each case (``sends[r][p]``: rows rank r sends rank p) and patterned
  inputs (element (j, c) of the piece rank s cuts for rank d is 1000 s + 100 d + 10 j + c,
  so a wrong output says where its rows came from);
- 7.2: two partial attention results of one set of queries over two blocks of keys;
- 7.3: q, k, v of the whole sequence, and dense causal attention on it;
- 7.4: what forward saved (output, log-sum-exp) and the output's gradient, and dense
  causal attention's gradients;
- 7.6: router logits, and the probabilities, choices, gates and balancing loss (with its
  gradient) a token-by-token loop gives;
- 7.7: router choices, and the dispatch and combine a loop gives, serving every first
  choice before any second;
- 7.8: q, k, v and an output gradient of the whole sequence, dense attention on it and
  its gradients.
"""
from __future__ import annotations

import math
import random

import torch

# ---- groups: the world, and on 3 ranks the pair {0, 1} ----------------------------------------
def group_cases(world):
    """(where, use_pair): the world, and on 3 ranks the pair {1, 2} too (its group-local
    ranks 0 and 1 are global ranks 1 and 2)."""
    return [("the world", False)] + ([("ranks {1, 2} of 3", True)] if world == 3 else [])


def members(world, use_pair, rank):
    """The global ranks of ``rank``'s group."""
    if not use_pair:
        return list(range(world))
    return [1, 2] if rank > 0 else [0]


# ---- 7.1: all-to-all -----------------------------------------------------------------------
def all_to_all_cases(world, seed=71):
    """[(label, sends (n x n rows), row width or None for 1-D, dtype)] for a group of
    ``world`` ranks."""
    rng = random.Random(seed + world)
    n = world
    cases = [("even splits, 2 rows per peer", [[2] * n for _ in range(n)], 3, torch.float32)]
    uneven = [[rng.randint(1, 4) for _ in range(n)] for _ in range(n)]
    cases.append(("uneven splits", uneven, 2, torch.float32))
    if n > 1:
        zeros = [[0 if (s == 0 or d == n - 1) else rng.randint(1, 3) for d in range(n)]
                 for s in range(n)]
        zeros[0][0] = 2  # rank 0 keeps rows for itself but sends no one anything
        cases.append(("zero-row splits (rank 0 sends no peer anything, rank "
                      f"{n - 1} receives nothing)", zeros, None, torch.int64))
    return cases


def piece(src, dst, rows, width, dtype):
    """The rows rank ``src`` cuts for rank ``dst``."""
    j = torch.arange(rows, dtype=torch.int64).unsqueeze(1) * 10
    c = torch.arange(width or 1, dtype=torch.int64).unsqueeze(0)
    block = (1000 * src + 100 * dst + j + c).to(dtype)
    return block if width else block.squeeze(1)


def all_to_all_input(sends, rank, width, dtype):
    return torch.cat([piece(rank, d, k, width, dtype) for d, k in enumerate(sends[rank])])


def all_to_all_output(sends, rank, width, dtype):
    return torch.cat([piece(s, rank, sends[s][rank], width, dtype) for s in range(len(sends))])


def source_of(value):
    """The sending rank of a patterned element (None: never written, -1)."""
    return None if value < 0 else int(value) // 1000


# ---- 7.2 and 7.3: attention ---------------------------------------------------------------
def seeded(seed, *shape, dtype=torch.float64, scale=1.0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    draw = torch.randn(*shape, generator=gen, device="cpu", dtype=torch.float64)
    return draw.mul(scale).to(dtype)


def dense_attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d)) v and its log-sum-exp, over every key of ``k``."""
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v.double()
    return out.to(q.dtype), lse.to(q.dtype)


def merge_cases(offset=0):
    """[(label, out_a, lse_a, out_b, lse_b, out, lse)]: two halves of the keys and the
    attention over all of them (``offset`` added to every seed: the hidden settings)."""
    cases = []
    specs = [("8 queries over 6 + 10 keys", 8, 6, 10, None, 1.0, torch.float64, 1),
             ("5 queries over 7 + 3 keys, batch 2 x 3 heads", 5, 7, 3, (2, 3), 1.0,
              torch.float64, 2),
             ("causal: the first 4 queries see no key of the second block", 8, 4, 4, None, 1.0,
              torch.float64, 3)]
    for label, s_q, s_a, s_b, batch, scale, dtype, seed in specs:
        lead = batch or ()
        q = seeded(offset + seed, *lead, s_q, 8, dtype=dtype, scale=scale)
        k = seeded(offset + seed + 10, *lead, s_a + s_b, 8, dtype=dtype)
        v = seeded(offset + seed + 20, *lead, s_a + s_b, 8, dtype=dtype)
        mask = None
        if label.startswith("causal"):  # queries at positions 0..7, keys 0..7: causal
            mask = torch.arange(s_a + s_b).unsqueeze(0) <= torch.arange(s_q).unsqueeze(1)
        parts = [dense_attention(q, k[..., sl, :], v[..., sl, :],
                                 None if mask is None else mask[:, sl])
                 for sl in (slice(0, s_a), slice(s_a, s_a + s_b))]
        out, lse = dense_attention(q, k, v, mask)
        cases.append((label, *parts[0], *parts[1], out, lse))
    # float32 with log-sum-exps near 300 on both sides (e^300 overflows float32, and the
    # two weights are comparable: neither side may be ignored), against float64
    lse_a, lse_b = (300 + seeded(offset + 31 + i, 6, scale=2.0).float().double() for i in range(2))
    out_a, out_b = (seeded(offset + 33 + i, 6, 8).float().double() for i in range(2))
    lse = torch.logaddexp(lse_a, lse_b)
    out = (torch.exp(lse_a - lse).unsqueeze(-1) * out_a
           + torch.exp(lse_b - lse).unsqueeze(-1) * out_b)
    cases.append(("log-sum-exps near 300 in float32", *(t.float() for t in (
        out_a, lse_a, out_b, lse_b, out, lse))))
    # an accumulator that starts empty (o = 0, l = -inf) meets a block that queries 0-2
    # cannot see at all: their rows stay empty, o = 0 and l = -inf, not nan
    q, k, v = seeded(offset + 5, 6, 8), seeded(offset + 15, 5, 8), seeded(offset + 25, 5, 8)
    mask = torch.arange(5).unsqueeze(0) <= torch.arange(6).unsqueeze(1) - 3
    out, lse = dense_attention(q, k, v, mask)
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    cases.append(("an empty start (o = 0, l = -inf) and rows that see no key at all", *empty,
                  out, lse, out, lse))
    return cases


RING_SHAPE = (2, 2, 5, 4)  # (batch, heads, tokens per rank: odd, head dim)


def ring_qkv(world):
    """q, k, v of the whole sequence: (batch, heads, world x 5, head dim), float64."""
    b, h, s, d = RING_SHAPE
    return tuple(seeded(100 * world + i, b, h, world * s, d) for i in range(3))


def ring_expected(world):
    """Dense causal attention on the whole sequence."""
    q, k, v = ring_qkv(world)
    n = q.shape[-2]
    mask = torch.arange(n).unsqueeze(0) <= torch.arange(n).unsqueeze(1)
    return dense_attention(q, k, v, mask)[0]


def ring_saved(world):
    """What the forward saved and backward is given: the output O of dense causal
    attention on ring_qkv(world), its log-sum-exp, and the output's gradient dO."""
    q, k, v = ring_qkv(world)
    n = q.shape[-2]
    mask = torch.arange(n).unsqueeze(0) <= torch.arange(n).unsqueeze(1)
    out, lse = dense_attention(q, k, v, mask)
    b, h, s, d = RING_SHAPE
    return out, lse, seeded(100 * world + 7, b, h, world * s, d)


def ring_gradients(world):
    """dq, dk, dv of dense causal attention on ring_qkv(world) for ring_saved's dO,
    by autograd through plain softmax math."""
    q, k, v = (t.clone().requires_grad_() for t in ring_qkv(world))
    n = q.shape[-2]
    mask = torch.arange(n).unsqueeze(0) <= torch.arange(n).unsqueeze(1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
    out.backward(ring_saved(world)[2])
    return q.grad, k.grad, v.grad


def block_backward_flops():
    """Floating-point operations of one block in backward: q k^T, P^T dO, dO v^T, dS k and
    dS^T q."""
    b, h, s, d = RING_SHAPE
    return 5 * (2 * b * h * s * s * d)


def block_flops():
    """Floating-point operations of one block of the ring: q k^T and p v."""
    b, h, s, d = RING_SHAPE
    return 2 * (2 * b * h * s * s * d)


# ---- 7.6: the router -------------------------------------------------------------------------
def router_cases(seed=75):
    """[(logits (T, E) float64, k)]: random logits (no ties), from one expert per token to
    every expert, and a router that prefers one expert."""
    rng = random.Random(seed)
    cases = []
    for tokens, experts, k in [(6, 4, 1), (8, 4, 2), (12, 8, 2), (5, 3, 3), (9, 6, 2)]:
        gen = torch.Generator(device="cpu").manual_seed(rng.randrange(2**31))
        logits = torch.randn(tokens, experts, generator=gen, device="cpu", dtype=torch.float64)
        cases.append((logits, k))
    skewed = cases[1][0].clone()
    skewed[:, 2] += 2.0  # most first choices on expert 2
    cases.append((skewed, 2))
    return cases


def expected_route(logits, k):
    """(probs, gates, chosen, aux, d aux / d logits), token by token: each token's softmax
    over the experts, its k experts by falling probability and their probabilities, then
    aux = E sum_e f_e P_e with f_e the share of first choices (a count, no gradient) and
    P_e the mean probability, whose gradient is (E/T) p_ti (f_i - sum_e f_e p_te)."""
    tokens, experts = logits.shape
    probs = torch.zeros_like(logits)
    chosen = torch.zeros(tokens, k, dtype=torch.long)
    for t in range(tokens):
        e_l = [math.exp(x - max(logits[t].tolist())) for x in logits[t].tolist()]
        probs[t] = torch.tensor([x / sum(e_l) for x in e_l], dtype=logits.dtype)
        chosen[t] = torch.tensor(sorted(range(experts), key=lambda e: -probs[t, e].item())[:k])
    gates = torch.stack([probs[t, chosen[t]] for t in range(tokens)])
    f = torch.tensor([sum(1 for t in range(tokens) if chosen[t, 0] == e) / tokens
                      for e in range(experts)], dtype=logits.dtype)
    mean_p = probs.mean(0)
    aux = experts * (f * mean_p).sum()
    grad = experts / tokens * probs * (f.unsqueeze(0) - (probs * f).sum(-1, keepdim=True))
    return probs, gates, chosen, aux, grad


# ---- 7.8: Ulysses ---------------------------------------------------------------------------
ULYSSES_SHAPE = (2, 6, 5, 4)  # (batch, heads: divisible by 1, 2 and 3, tokens per rank, d)


def ulysses_inputs(world):
    """q, k, v and the output's gradient of the whole sequence, float64:
    (batch, heads, world x 5, head dim) each."""
    b, h, s, d = ULYSSES_SHAPE
    return tuple(seeded(500 + 10 * world + i, b, h, world * s, d) for i in range(4))


def ulysses_expected(world, causal, local_only=False):
    """Dense attention on the whole sequence and its gradients (out, dq, dk, dv), by
    autograd through plain softmax math; ``local_only``: each rank's tokens attending only
    to its own (the answer of a rank that never exchanged anything)."""
    q, k, v, g = (t.clone() for t in ulysses_inputs(world))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    n, s = q.shape[-2], ULYSSES_SHAPE[2]
    position = torch.arange(n)
    mask = torch.ones(n, n, dtype=torch.bool)
    if causal:
        mask &= position.unsqueeze(0) <= position.unsqueeze(1)
    if local_only:
        mask &= (position // s).unsqueeze(0) == (position // s).unsqueeze(1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


# ---- 7.7: dispatch and combine ------------------------------------------------------------
def dispatch_cases(seed=74):
    """[(chosen (T, k), n_experts, n_ranks, capacity)]."""
    rng = random.Random(seed)
    cases = [(torch.tensor([[0, 2], [2, 1], [0, 3], [0, 2], [1, 0], [3, 2]]), 4, 2, 3),
             # token by token, token 0's second choice would take expert 0's one slot
             (torch.tensor([[1, 0], [0, 1], [2, 0], [0, 2]]), 3, 3, 1)]
    for n_tokens, k, experts, ranks, cap in [(10, 1, 4, 2, 3), (16, 2, 6, 3, 4),
                                             (9, 2, 4, 4, 9), (20, 3, 8, 2, 5), (7, 1, 3, 3, 1)]:
        chosen = [rng.sample(range(experts), k) for _ in range(n_tokens)]
        cases.append((torch.tensor(chosen), experts, ranks, cap))
    return cases


def expected_dispatch(chosen, n_experts, n_ranks, capacity, first_choices_first=True):
    """(order, counts) by a loop: keep an assignment while its expert has room, serving
    every token's first choice, then every second one (``first_choices_first=False``:
    token by token, the order a = t k + j), then group the kept ones by expert."""
    flat = chosen.reshape(-1).tolist()
    n_tokens, k = chosen.shape
    queue = (sorted(range(len(flat)), key=lambda a: (a % k, a // k)) if first_choices_first
             else range(len(flat)))
    taken, kept = [0] * n_experts, []
    for a in queue:
        e = flat[a]
        if taken[e] < capacity:
            taken[e] += 1
            kept.append(a)
    order = sorted(kept, key=lambda a: (flat[a], a))
    per_rank = n_experts // n_ranks
    counts = [sum(1 for a in order if flat[a] // per_rank == r) for r in range(n_ranks)]
    return order, counts


def combine_inputs(chosen, order, seed):
    """(rows (len(order), 5), gates (T, k)) for a combine call, float32 as in the layer."""
    rows = seeded(seed, len(order), 5, dtype=torch.float32)
    gates = seeded(seed + 1, *chosen.shape, dtype=torch.float32).abs()
    return rows, gates


def expected_combine(rows, order, gates, n_tokens):
    k = gates.shape[-1]
    out = torch.zeros(n_tokens, rows.shape[-1], dtype=rows.dtype)
    for i, a in enumerate(order):
        out[a // k] += gates[a // k, a % k] * rows[i]
    return out
