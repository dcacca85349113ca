"""Exercise 7.5's check: the zigzag layout, the positions a rank holds and the pieces of
each block its queries compute. Both are called in the student's process; the ring they
describe is then worked out here, in the checking process: every rank's queries, in the
student's positions, attend to every owner's block piece by piece and merge (what the
ring computes, one rank after another), and the output and the q, k, v gradients are
compared with dense causal attention. Where a piece goes wrong (seeing a later key,
missing a visible one, counting one twice) only chooses the hint. The pieces must also
skip what no query sees, so every rank computes (2n + 1)/4 of a block's scores, a
diagonal piece counted as its whole square."""
from __future__ import annotations

import random

import torch

from course_lib.cp.blockwise import attention_with_lse, causal_mask, chunk_positions, merge
from course_lib.grading import checks
from course_lib.grading.requests import here

EX_ZIGZAG = "Exercise 7.5"


def zigzag_job(positions_fn, pieces_fn, layouts):
    """In the student's process: for each (world, s_local), every rank's positions and,
    for every (rank, owner), the pieces as (q_start, q_stop, k_start, k_stop, diagonal);
    then whether ``positions_fn`` refuses a sequence that does not cut into 2n chunks."""
    def attempt(fn, *args):
        try:
            return {"value": fn(*args)}
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the answer, for the check to judge
            return {"raised": type(exc).__name__, "message": str(exc)[:300]}

    def plain(pieces, s_local):
        def bounds(rows):  # slice(h, None) and slice(None, h) are rows too
            start, stop, step = rows.indices(s_local)
            if step != 1:
                raise ValueError(f"a slice with step {step}")
            return start, stop

        try:
            return [(*bounds(q), *bounds(k), bool(d)) for q, k, d in pieces]
        except Exception as exc:  # noqa: BLE001 - not a list of (slice, slice, bool)
            return {"malformed": f"{type(exc).__name__}: {exc}"[:300]}

    answers = []
    for n, s_local in layouts:
        positions = [attempt(positions_fn, r, n, n * s_local) for r in range(n)]
        pieces = {}
        for r in range(n):
            for owner in range(n):
                got = attempt(pieces_fn, n, r, owner, s_local)
                pieces[f"{r},{owner}"] = ({"value": plain(got["value"], s_local)}
                                          if "value" in got else got)
        answers.append({"positions": positions, "pieces": pieces})
    refused = attempt(positions_fn, 0, 2, 6)
    return answers, "raised" in refused and refused["raised"] == "ValueError"


def layouts(seed):
    """(world, tokens per rank): 1-3 ranks and a larger world, each with an even s_local."""
    rng = random.Random(seed)
    return [(n, 2 * rng.choice((2, 3, 4))) for n in (1, 2, 3, rng.choice((4, 5)))]


@checks.check(EX_ZIGZAG, hidden=checks.reseeded)
def check_zigzag(zigzag_positions, zigzag_pieces, seed=75):
    ex = EX_ZIGZAG
    cases = layouts(seed)
    answers, refused = yield here(zigzag_job, zigzag_positions, zigzag_pieces, cases)
    for (n, s_local), answer in zip(cases, answers):
        positions = _grade_positions(ex, n, s_local, answer["positions"])
        pieces = {}
        for r in range(n):
            for owner in range(n):
                call = f"zigzag_pieces(world={n}, rank={r}, owner={owner}, s_local={s_local})"
                pieces[r, owner] = _valid_pieces(ex, call, answer["pieces"][f"{r},{owner}"],
                                                 s_local)
        _grade_ring(ex, n, s_local, positions, pieces, seed)
        block = s_local * s_local
        for r in range(n):
            scores = sum((q1 - q0) * (k1 - k0) for o in range(n) for q0, q1, k0, k1, _ in
                         pieces[r, o])
            if 4 * scores < (2 * n + 1) * block:
                raise checks.CheckFailed(
                    f"{ex}: world {n}, s_local {s_local}: rank {r}'s pieces are right but "
                    f"count {scores} scores, fewer than (2n+1)/4 of a block.\nHint: a "
                    f"diagonal piece is one whole chunk against itself (s_local/2 rows)")
            if 4 * scores > (2 * n + 1) * block:
                raise checks.CheckFailed(
                    f"{ex}: world {n}, s_local {s_local}: rank {r}'s pieces are right but "
                    f"compute {scores} scores, {scores / block:.2f} of a block, not "
                    f"(2n+1)/4 = {(2 * n + 1) / 4:.2f}.\nHint: on its own block the early "
                    f"queries see none of the late keys: that quarter is skipped too (three "
                    f"pieces: two diagonal squares and the late-queries, early-keys square)")
    if not refused:
        raise checks.CheckFailed(f"{ex}: zigzag_positions(0, 2, 6) did not raise a ValueError: "
                                 f"6 tokens do not cut into 4 equal chunks")
    return (f"world sizes {[n for n, _ in cases]}: positions, and pieces whose ring equals "
            f"dense causal attention and its gradients, (2n+1)/4 of a block per rank")


def _grade_positions(ex, n, s_local, answers):
    found = []
    for r, answer in enumerate(answers):
        call = f"zigzag_positions({r}, {n}, {n * s_local})"
        got = checks.answer_value(ex, call, answer)
        want = chunk_positions(r, n, n * s_local, "zigzag")
        if not isinstance(got, torch.Tensor):
            raise checks.CheckFailed(f"{ex}: {call} returned a {type(got).__name__}, not a "
                                     f"tensor.\nHint: return a long tensor of the positions "
                                     f"(torch.cat of torch.arange pieces)")
        if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(
                got.long(), want):
            found.append(want)
            continue
        shown = got.tolist() if isinstance(got, torch.Tensor) else repr(got)
        hint = "cut the sequence into 2n chunks; rank r holds chunk r, then chunk 2n-1-r"
        if isinstance(got, torch.Tensor) and torch.equal(
                got.long().sort().values, want.sort().values):
            hint = "the right positions in another order: chunk r first, then chunk 2n-1-r"
        elif isinstance(got, torch.Tensor) and got.numel() == s_local and torch.equal(
                got.long(), chunk_positions(r, n, n * s_local)):
            hint = "that is the contiguous layout (chunk r of n); zigzag cuts 2n chunks"
        raise checks.CheckFailed(f"{ex}: {call} returned {shown}, expected {want.tolist()}.\n"
                                 f"Hint: {hint}")
    return found


def _valid_pieces(ex, call, answer, s_local):
    got = checks.answer_value(ex, call, answer)
    if isinstance(got, dict):
        raise checks.CheckFailed(f"{ex}: {call} must return a list of (query rows, key rows, "
                                 f"diagonal), rows as slices ({got['malformed']})")
    for q0, q1, k0, k1, diagonal in got:
        if not (0 <= q0 < q1 <= s_local and 0 <= k0 < k1 <= s_local):
            raise checks.CheckFailed(f"{ex}: {call}: the piece ({q0}:{q1}, {k0}:{k1}) is not "
                                     f"a non-empty slice of the {s_local} local rows")
        if diagonal and q1 - q0 != k1 - k0:
            raise checks.CheckFailed(f"{ex}: {call}: the diagonal piece ({q0}:{q1}, {k0}:{k1}) "
                                     f"is not square: a diagonal piece is one chunk against "
                                     f"itself")
    return got


def _ring(q, k, v, positions, pieces):
    """Each rank's output as the ring computes it from ``pieces``, back in sequence order."""
    n = len(positions)
    out = torch.zeros_like(q)
    for r in range(n):
        q_r = q[..., positions[r], :]
        o = torch.zeros_like(q_r)
        lse = torch.full(q_r.shape[:-1], float("-inf"), dtype=q.dtype)
        for owner in range(n):
            k_o, v_o = k[..., positions[owner], :], v[..., positions[owner], :]
            for q0, q1, k0, k1, diagonal in pieces[r, owner]:
                mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril() if diagonal \
                    else None
                o_p, l_p = attention_with_lse(q_r[..., q0:q1, :], k_o[..., k0:k1, :],
                                              v_o[..., k0:k1, :], mask)
                merged = merge(o[..., q0:q1, :], lse[..., q0:q1], o_p, l_p)
                o, lse = o.clone(), lse.clone()  # autograd keeps the values merged from
                o[..., q0:q1, :], lse[..., q0:q1] = merged
        out = out.clone()
        out[..., positions[r], :] = o
    return out


def _grade_ring(ex, n, s_local, positions, pieces, seed):
    s = n * s_local
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, s, 4, generator=generator, dtype=torch.float64,
                           device="cpu", requires_grad=True) for _ in range(3))
    weights = torch.randn(1, 2, s, 4, generator=generator, dtype=torch.float64, device="cpu")
    everywhere = torch.arange(s)
    dense, _ = attention_with_lse(q, k, v, causal_mask(everywhere, everywhere))
    want = [dense.detach(), *torch.autograd.grad((dense * weights).sum(), (q, k, v))]
    ring = _ring(q, k, v, positions, pieces)
    got = [ring.detach(), *torch.autograd.grad((ring * weights).sum(), (q, k, v),
                                               allow_unused=True)]
    for what, mine, expected in zip(("output", "dq", "dk", "dv"), got, want):
        if mine is None or not torch.allclose(mine, expected, rtol=1e-9, atol=1e-9):
            raise checks.CheckFailed(f"{ex}: world {n}, s_local {s_local}: the ring your "
                                     f"pieces describe gives another {what} than dense causal "
                                     f"attention.\nHint: {_mistake(n, positions, pieces)}")


def _mistake(n, positions, pieces):
    """The first (rank, owner) whose pieces see a future key, miss a visible one, or count
    one twice."""
    for (r, owner), found in pieces.items():
        s_local = len(positions[r])
        seen = torch.zeros(s_local, s_local, dtype=torch.int64)
        for q0, q1, k0, k1, diagonal in found:
            part = torch.ones(q1 - q0, k1 - k0, dtype=torch.int64)
            seen[q0:q1, k0:k1] += part.tril() if diagonal else part
        visible = causal_mask(positions[r], positions[owner])
        where = f"rank {r}'s queries on the block of rank {owner}"
        if (seen > 1).any():
            return f"{where}: some query-key pairs are in two pieces (counted twice)"
        if (seen.bool() & ~visible).any():
            return (f"{where}: a piece lets queries see keys at later positions; a query of "
                    f"a chunk sees all of an earlier chunk, none of a later one, and its own "
                    f"chunk up to itself (diagonal)")
        if (visible & ~seen.bool()).any():
            if owner == r:
                return (f"{where}: some keys the queries may see are in no piece; on its own "
                        f"block the late queries see all of the early chunk, and each chunk "
                        f"sees itself up to the diagonal")
            return (f"{where}: some keys the queries may see are in no piece; under zigzag "
                    f"another rank's block is half visible, never empty")
    return "every piece matches the causal mask: do the pieces use the local rows, 0 to s_local?"
