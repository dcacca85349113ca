"""Checks of Lab 01's exercises: collectives from send/recv.

Each runs the student's collective on world sizes 1-3 with sizes that do not
divide evenly, compares every rank's result with torch's built-in computed in
the same job, and grades the traffic: how many messages and bytes, and to whom
(a ring talks only to its neighbours). A ring all-reduce that moves the whole
tensor at every step gives the right numbers but fails here, and so does a
"pipelined" broadcast that forwards nothing until it holds the whole tensor.

The first case of every check is small and patterned, so that a failure shows
where each number came from (element j of chunk c on rank i is 100c + 10i + j);
a wrong answer is diagnosed against the likely mistakes (an ignored ``op``, a
chunk off by one, a rank left out) and the hint says which one it looks like.
"""
from __future__ import annotations

from itertools import combinations

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.collectives.reduce_ops import chunk_bounds, combine
from course_lib.grading import checks
from course_lib.grading.message_order import message_order, received_before_each_send
from course_lib.runtime.backend import builtin_all_gather, builtin_reduce_scatter

SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX
OP_NAMES = {SUM: "SUM", MAX: "MAX"}
WHOLE_TENSOR_HINT = ("your rank sends far more than a ring should: the whole tensor seems to "
                     "travel at every step. Split it into world_size chunks and send one "
                     "chunk per step.")
RS_CHUNK_HINT = ("At step s (0 .. K-2) rank r sends to rank (r + 1) % K its partial result of "
                 "chunk (r - s - 1) % K (at step 0 that is its own input's chunk (r - 1) % K), "
                 "receives from rank (r - 1) % K the partial of chunk (r - s - 2) % K and adds "
                 "its own input's chunk of that same index. After K-1 steps it holds chunk r. "
                 "Trace K = 3 on paper: which chunk does each rank hold after each step?")
AG_CHUNK_HINT = ("Copy your input into chunk r of output first; then at step s (0 .. K-2) rank r "
                 "forwards chunk (r - s) % K to rank (r + 1) % K and receives chunk "
                 "(r - s - 1) % K from rank (r - 1) % K, straight into its place in output.")
PIPELINE_HINT = ("a pipelined rank forwards segment s before it receives segment s+1: at each "
                 "step send on the segment that arrived at the previous step and receive the "
                 "next one, in the same comm.exchange(sends=[...], recvs=[...]). Then every "
                 "link of the chain carries a segment at once, (K-2+S) steps in all.")


def _op_name(op):
    return OP_NAMES.get(op, str(op))


# ---- inputs and cases ----------------------------------------------------------------------
def _inputs(numel, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-100, 100, (numel,), generator=gen)
    return torch.randn(numel, generator=gen, dtype=dtype)


def _patterned(rank, chunks, numel):
    """Element j of chunk c on ``rank`` is 100c + 10 rank + j: readable in a failure."""
    c = torch.arange(chunks).repeat_interleave(numel)
    j = torch.arange(numel).repeat(chunks)
    return 100 * c + 10 * rank + j


PATTERN_NUMEL = 7  # fits in the 8 values a failure message shows


def _cases(sizes, dtypes=(torch.int64, torch.float32), ops=(SUM, MAX)):
    """[(numel, dtype, op, patterned)]: the patterned integer cases first, then random
    ones, several elements before single ones (a 1-element failure shows no pattern)."""
    cases = [(PATTERN_NUMEL, torch.int64, op, True) for op in ops]
    ordered = sorted(sizes, key=lambda n: (n < 2, n))
    return cases + [(n, dt, op, False) for n in ordered for dt in dtypes for op in ops]


def _describe_case(numel, dtype, op, patterned, rank_pattern):
    dt = str(dtype).replace("torch.", "")
    text = f"{numel} elements of {dt}" + (f", op {_op_name(op)}" if op is not None else "")
    return text + (f" (inputs: {rank_pattern})" if patterned else "")


# ---- comparing without raising -------------------------------------------------------------
def _same(got, want, n=1):
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and got.dtype == want.dtype
            and torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-5 * n))


def _reduce(tensors, op):
    acc = tensors[0].clone()
    for t in tensors[1:]:
        combine(acc, t, op)
    return acc


def _expect_values(ex, got, want, *, rank, n, what, hint):
    """``checks.expect_close``, with the hint worked out only when the values are
    wrong (``hint`` is a function returning text)."""
    try:
        checks.expect_close(ex, got, want, rank=rank, world_size=n, what=what,
                            rtol=1e-5, atol=1e-5 * n)
    except checks.CheckFailed as exc:
        raise checks.CheckFailed(f"{exc}\nHint: {hint()}") from None


def _expect_peers(ex, stats, *, rank, n, sent, received, hint):
    """Where the bytes went: the set of peers this rank sent to and received from."""
    for what, key, want in (("sent to", "sent_to", sent), ("received from", "recv_from", received)):
        per_peer = stats[key]
        if set(per_peer) != set(want):
            raise checks.CheckFailed(
                f"{ex}: rank {rank} of world size {n} {what} ranks {sorted(per_peer)} "
                f"(bytes per rank: {dict(sorted(per_peer.items()))}); expected "
                f"{sorted(want) if want else 'no one'}."
                f"\nHint: {hint(what, set(per_peer), rank, n)}")


def _ring_peer_hint(kind):
    def hint(what, peers, rank, n):
        sending = what == "sent to"
        if sending and len(peers) > 1:
            return (f"you send to several ranks. In a ring {kind} every message goes to the "
                    "right neighbour, (rank + 1) % K, even when a chunk belongs to a rank "
                    "further on: it gets there over several steps. Sending each chunk straight "
                    "to its owner moves the same bytes but keeps K-1 links per rank busy "
                    "instead of one, which is not what a ring is for.")
        rule = (f"in a ring {kind} every rank sends to its right neighbour, (rank + 1) % K, "
                "and receives from its left neighbour, (rank - 1) % K, at every step")
        if not peers:
            return f"this rank {'sent' if sending else 'received'} nothing, but {rule}."
        opposite = (rank - 1) % n if sending else (rank + 1) % n
        if peers == {opposite}:
            return f"You have the direction reversed: {rule}."
        return f"{rule[0].upper()}{rule[1:]}, and with no one else."
    return hint


# ---- all-reduce: Exercises 1.1 and 1.4 -----------------------------------------------------
def _all_reduce_job(fn, cases):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for i, (numel, dtype, op, patterned) in enumerate(cases):
        x = _patterned(rank, 1, numel) if patterned else _inputs(numel, dtype, 100 * i + rank)
        want = x.clone()
        dist.all_reduce(want, op=op)
        inputs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(inputs, x)
        got = x.clone()
        with comm.counting() as stats:
            fn(got, op)
        out.append((got, want, stats.as_dict(), inputs))
    return out


def _diagnose_all_reduce(got, want, op, rank, inputs, otherwise):
    """A hint naming what ``got`` looks like, or ``otherwise``."""
    n = len(inputs)
    if op != SUM and _same(got, _reduce(inputs, SUM), n):
        return (f"that is the SUM of the inputs, but op was {_op_name(op)}: your code ignores "
                "`op`. Pass it on wherever you combine: combine(tensor, incoming, op).")
    if _same(got, inputs[rank]):
        return (f"rank {rank} still holds its own input: nothing arrived from the other ranks "
                "(or it arrived in a buffer you did not copy back into `tensor`).")
    for size in range(1, n):
        for subset in combinations(range(n), size):
            if _same(got, _reduce([inputs[r] for r in subset], op), n):
                missing = sorted(set(range(n)) - set(subset))
                return (f"that is the {_op_name(op)} of the inputs of ranks {list(subset)} only: "
                        f"rank(s) {missing} are missing. Did rank 0 receive into its own tensor, "
                        "overwriting it, instead of into a scratch buffer folded in with combine?"
                        if size == 1 else
                        f"that is the {_op_name(op)} of the inputs of ranks {list(subset)} only: "
                        f"the contribution of rank(s) {missing} is missing.")
    return otherwise


def _grade_all_reduce(ex, fn, world_sizes, sizes, traffic, hint):
    cases = _cases(sizes)
    for n in world_sizes:
        outs = checks.launch(ex, _all_reduce_job, fn, cases, nproc=n)
        for case, per_rank in zip(cases, zip(*outs)):
            numel, dtype, op, patterned = case
            what = "the result for " + _describe_case(numel, dtype, op, patterned,
                                                      "element j on rank i is 10i + j")
            for rank, (got, want, stats, inputs) in enumerate(per_rank):
                _expect_values(ex, got, want, rank=rank, n=n, what=what,
                               hint=lambda: _diagnose_all_reduce(got, want, op, rank, inputs, hint))
                traffic(ex, rank, n, numel, got.element_size(), stats)
    checks.passed(ex, f"world sizes {list(world_sizes)}, sizes {sizes}, SUM and MAX, "
                      "int64 and float32")


def check_naive_all_reduce(fn, world_sizes=(1, 2, 3), sizes=(1, 7, 1001)):
    def peer_hint(*_):
        return ("every other rank sends its tensor to rank 0 and receives the result from "
                "rank 0; rank 0 receives from and sends to each of the others once.")

    def traffic(ex, rank, n, numel, elsize, stats):
        others = set(range(1, n)) if rank == 0 else ({0} if n > 1 else set())
        _expect_peers(ex, stats, rank=rank, n=n, sent=others, received=others, hint=peer_hint)
        want = len(others)
        checks.expect_equal(ex, (stats["sent_messages"], stats["recv_messages"]), (want, want),
                            rank=rank, world_size=n, what="(messages sent, received)",
                            hint="every other rank sends its tensor to rank 0 and receives "
                                 "the result back; rank 0 receives n-1 and sends n-1")

    _grade_all_reduce("Exercise 1.1", fn, world_sizes, sizes, traffic,
                      hint="rank 0 receives every other rank's tensor into a scratch buffer, "
                           "folds each into its own with combine(tensor, incoming, op), then "
                           "sends the result to every other rank, which receives it into "
                           "its `tensor`.")


def check_ring_all_reduce(fn, world_sizes=(1, 2, 3), sizes=(1, 7, 1001)):
    peer_hint = _ring_peer_hint("all-reduce")

    def traffic(ex, rank, n, numel, elsize, stats):
        if n == 1:
            return checks.expect_equal(ex, stats["sent_messages"], 0, rank=rank, world_size=1,
                                       what="messages sent", hint="one rank has no one to talk to")
        nbytes = numel * elsize
        # 2(n-1) chunks of ceil(N/n) elements: padding to a multiple of n is allowed
        ring_bytes = 2 * (n - 1) * -(-numel // n) * elsize
        if stats["sent_bytes"] > ring_bytes:
            hint = WHOLE_TENSOR_HINT if stats["sent_bytes"] >= (n - 1) * nbytes else (
                "each of the 2(n-1) messages should carry one chunk of about N/n bytes")
            raise checks.CheckFailed(
                f"{ex}: rank {rank} of world size {n} sent {stats['sent_bytes']} bytes for a "
                f"{nbytes}-byte tensor; a ring sends 2(n-1)/n of it, at most {ring_bytes}."
                f"\nHint: {hint}")
        right, left = (rank + 1) % n, (rank - 1) % n
        # with fewer elements than ranks, empty chunks may be skipped
        _expect_peers(ex, stats, rank=rank, n=n, hint=peer_hint,
                      sent={right} if stats["sent_to"] or numel >= n else set(),
                      received={left} if stats["recv_from"] or numel >= n else set())
        if numel >= n:
            checks.expect_equal(ex, stats["sent_messages"], 2 * (n - 1), rank=rank,
                                world_size=n, what="messages sent",
                                hint="reduce-scatter (n-1 steps) then all-gather (n-1 steps)")

    _grade_all_reduce("Exercise 1.4", fn, world_sizes, sizes, traffic,
                      hint="copy the flattened tensor into a zero-padded buffer of K * ceil(N/K) "
                           "elements, reduce-scatter it (with `op`) into a chunk of ceil(N/K), "
                           "all-gather the chunks back into the buffer and copy its first N "
                           "elements into `tensor`.")


# ---- reduce-scatter and all-gather: Exercises 1.2 and 1.3 ----------------------------------
UNWRITTEN = -1  # what a patterned case's output holds before the student's call


def _output(numel, dtype, patterned):
    """The output buffer handed to the student: uninitialised, as in real use, except
    in the patterned case, where the values a failure shows should all mean something."""
    if patterned:
        return torch.full((numel,), UNWRITTEN, dtype=dtype)
    return torch.empty(numel, dtype=dtype)


def _rs_ag_job(fn, kind, cases):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for i, (numel, dtype, op, patterned) in enumerate(cases):
        if kind == "reduce_scatter":
            inp = (_patterned(rank, world, numel) if patterned
                   else _inputs(world * numel, dtype, 100 * i + rank))
            got, want = _output(numel, dtype, patterned), torch.empty(numel, dtype=dtype)
            builtin_reduce_scatter(want, inp, op=op)
            full = inp.clone()  # every chunk's reduction, to tell which one the student got
            dist.all_reduce(full, op=op)
            summed = inp.clone()
            dist.all_reduce(summed)
            refs = {"full": full, "sum": summed, "input": inp}
            with comm.counting() as stats:
                fn(got, inp, op)
        else:
            inp = _patterned(rank, 1, numel) if patterned else _inputs(numel, dtype, 100 * i + rank)
            got = _output(world * numel, dtype, patterned)
            want = torch.empty(world * numel, dtype=dtype)
            builtin_all_gather(want, inp)
            refs = {}
            with comm.counting() as stats:
                fn(got, inp)
        out.append((got, want, stats.as_dict(), refs))
    return out


def _head(t, limit=4):
    text = str(t[:limit].tolist())
    return text if t.numel() <= limit else text[:-1] + ", ...]"


def _chunks(t, n):
    return [t[c * n:(c + 1) * n] for c in range(t.numel() // n)] if n else []


def _diagnose_reduce_scatter(got, refs, op, rank, world, numel):
    full, own = _chunks(refs["full"], numel), _chunks(refs["input"], numel)
    if op != SUM and _same(got, _chunks(refs["sum"], numel)[rank], world):
        return (f"that is the SUM of chunk {rank}, but op was {_op_name(op)}: your code ignores "
                "`op`. Pass it on wherever you combine: combine(incoming, chunk(c), op).")
    for c in range(world):
        if c != rank and _same(got, full[c], world):
            return (f"that is the complete reduction of chunk {c}, not of chunk {rank}: your "
                    f"chunk indices are off by {(c - rank) % world} (mod K). {RS_CHUNK_HINT}")
    if got.numel() > 1 and bool((got == UNWRITTEN).all()):
        return (f"output still holds {UNWRITTEN}s, what it held before your call: copy the "
                "partial you hold after the last step into it.")
    for c in range(world):
        if _same(got, own[c]):
            return (f"that is chunk {c} of rank {rank}'s own input, with nothing from the other "
                    f"ranks folded in. {RS_CHUNK_HINT}")
    shown = "; ".join(f"chunk {c}: {_head(full[c])}" for c in range(world))
    return (f"it matches no chunk's reduction (the reductions are {shown}), so partial "
            f"results of different chunks got mixed. {RS_CHUNK_HINT}")


def _diagnose_all_gather(got, want, rank, world, numel):
    held = []
    for piece in _chunks(got, numel):
        owners = [k for k, w in enumerate(_chunks(want, numel)) if _same(piece, w)]
        if owners:
            held.append(f"rank {owners[0]}'s input")
        elif bool((piece == UNWRITTEN).all()):
            held.append(f"only {UNWRITTEN}s, what output held before your call")
        else:
            held.append("no rank's input")
    wrong = [c for c in range(world) if held[c] != f"rank {c}'s input"]
    where = ", ".join(f"chunk {c} holds {held[c]}" for c in wrong)
    return (f"chunk c of the output must hold rank c's input; here {where}. {AG_CHUNK_HINT}")


def _grade_rs_ag(ex, fn, kind, world_sizes, sizes):
    ops = (SUM, MAX) if kind == "reduce_scatter" else (None,)
    cases = _cases(sizes, ops=ops)
    name = kind.replace("_", "-")
    peer_hint = _ring_peer_hint(name)
    pattern = ("element j of chunk c on rank i is 100c + 10i + j" if kind == "reduce_scatter"
               else "element j on rank i is 10i + j")
    for n in world_sizes:
        outs = checks.launch(ex, _rs_ag_job, fn, kind, cases, nproc=n)
        for case, per_rank in zip(cases, zip(*outs)):
            numel, dtype, op, patterned = case
            what = "the output for chunks of " + _describe_case(numel, dtype, op, patterned,
                                                                pattern)
            for rank, (got, want, stats, refs) in enumerate(per_rank):
                right, left = (rank + 1) % n, (rank - 1) % n
                _expect_peers(ex, stats, rank=rank, n=n, hint=peer_hint,
                              sent={right} if n > 1 else set(),
                              received={left} if n > 1 else set())
                if kind == "reduce_scatter":
                    def hint():
                        return _diagnose_reduce_scatter(got, refs, op, rank, n, numel)
                else:
                    def hint():
                        return _diagnose_all_gather(got, want, rank, n, numel)
                _expect_values(ex, got, want, rank=rank, n=n, what=what, hint=hint)
                chunk_bytes = numel * got.element_size()
                checks.expect_equal(
                    ex, (stats["sent_messages"], stats["sent_bytes"]),
                    ((n - 1), (n - 1) * chunk_bytes), rank=rank, world_size=n,
                    what="(messages sent, bytes sent)",
                    hint=f"a ring {name} takes n-1 steps, each sending one chunk (1/n of the "
                         f"array) to the right neighbour")
    checks.passed(ex, f"world sizes {list(world_sizes)}, chunks of {sizes} elements, "
                      "to the right neighbour only")


def check_ring_reduce_scatter(fn, world_sizes=(1, 2, 3), sizes=(1, 7, 250)):
    _grade_rs_ag("Exercise 1.2", fn, "reduce_scatter", world_sizes, sizes)


def check_ring_all_gather(fn, world_sizes=(1, 2, 3), sizes=(1, 7, 250)):
    _grade_rs_ag("Exercise 1.3", fn, "all_gather", world_sizes, sizes)


# ---- pipelined broadcast: Exercise 1.5 -----------------------------------------------------
def _broadcast_job(fn, cases):
    rank = dist.get_rank()
    out = []
    for i, (numel, src, segments) in enumerate(cases):
        x = _broadcast_input(rank, numel)
        want = x.clone()
        dist.broadcast(want, src)
        with comm.counting() as stats, message_order() as events:
            fn(x, src, segments)
        out.append((x, want, stats.as_dict(), events))
    return out


def _broadcast_input(rank, numel):
    """What rank ``rank`` holds before the broadcast (as in ``_broadcast_job``)."""
    return torch.arange(numel, dtype=torch.float32) + 1000 * rank


def _diagnose_broadcast(got, numel, src, seg, rank, n):
    """Say what each segment of a wrong broadcast result holds, and what that points to."""
    bounds = [b for b in chunk_bounds(numel, seg) if b[1] > b[0]]
    if not isinstance(got, torch.Tensor) or got.shape != (numel,):
        return ("broadcast in place: write every segment into `tensor` itself (through "
                "views such as tensor[lo:hi]) and return it.")
    inputs = [_broadcast_input(q, numel) for q in range(n)]
    own, missing, foreign, moved = [], [], [], []
    for j, (lo, hi) in enumerate(bounds):
        piece = got[lo:hi]
        if _same(piece, inputs[src][lo:hi]):
            continue
        if rank != src and _same(piece, inputs[rank][lo:hi]):
            own.append(j)
            continue
        others = [q for q in range(n) if q not in (src, rank) and _same(piece, inputs[q][lo:hi])]
        if others:
            foreign.append((j, others[0]))
            continue
        sources = [i for i, (a, b) in enumerate(bounds)
                   if b - a == hi - lo and _same(piece, inputs[src][a:b])]
        if sources:
            moved.append((j, sources[0]))
        else:
            missing.append(j)
    pos = (rank - src) % n
    if own and len(own) == len(bounds):
        return ("every segment still holds this rank's own values, so nothing was received "
                "into `tensor`: receive straight into segment(j), a view of `tensor` (a "
                "scratch buffer that is only forwarded never reaches `tensor`).")
    if own and own == list(range(len(bounds) - len(own), len(bounds))):
        return (f"segment(s) {own} never arrived at this rank (position {pos} of the chain): "
                f"the last segments need more steps. Segment S-1 leaves the source at step "
                f"S-1 and needs K-1 hops: S+K-2 steps in all.")
    if own:
        return (f"segment(s) {own} never arrived at this rank (position {pos} of the chain); "
                f"each rank but the source must receive every segment once, from its left.")
    if foreign:
        j, q = foreign[0]
        return (f"segment {j} holds rank {q}'s original values, not the source's: a rank "
                f"forwarded its own data before it had received that segment. At step t "
                f"forward only the segment that arrived at step t-1.")
    if moved:
        j, k = moved[0]
        return (f"segment {j} holds the source's segment {k}: the segment a rank receives and "
                f"the place it writes it (or sends it from) do not match. Work out which "
                f"segment the rank at `pos` sends and receives at step t.")
    return (f"segment(s) {missing} match no rank's values: was a segment written while it was "
            "still being sent, or sent from a buffer that is reused?")


def _expect_pipelined(ex, events, *, rank, n, src, seg, pos):
    """A rank in the middle of the chain forwards segment s before it receives s+1."""
    before = received_before_each_send(events)
    late = [s for s, got in enumerate(before) if got > s + 1]
    if not late:
        return
    s = late[0]
    if before[0] >= seg:
        what = ("forwarded nothing until it had received all "
                f"{seg} segments: that is store-and-forward, (K-1)(alpha + N/B) in all, "
                "however many segments you cut")
    else:
        what = (f"had received {before[s]} of its {seg} segments before it forwarded segment "
                f"{s}, so each hop holds segments back")
    raise checks.CheckFailed(
        f"{ex}: rank {rank} of world size {n} (position {pos} of the chain from src={src}, "
        f"S={seg}) {what}. Order of its messages: {' '.join(events)}.\nHint: {PIPELINE_HINT}")


def check_pipelined_broadcast(fn, world_sizes=(1, 2, 3, 4), sizes=(1, 10, 1001)):
    ex = "Exercise 1.5"

    def peer_hint(*_):
        return ("in a chain broadcast each rank receives from its left neighbour, "
                "(rank - 1) % K, and forwards to its right, (rank + 1) % K; the source "
                "only sends and the last rank, (src - 1) % K, only receives.")

    for n in world_sizes:
        cases = [(numel, src, seg) for numel in sorted(sizes, key=lambda m: (m < 2, m))
                 for src in sorted({0, n - 1}) for seg in (4, 1)]
        outs = checks.launch(ex, _broadcast_job, fn, cases, nproc=n)
        for (numel, src, seg), per_rank in zip(cases, zip(*outs)):
            # values on every rank first: a wrong value says more about the mistake
            # than the message counts it causes on another rank
            for rank, (got, want, _, _) in enumerate(per_rank):
                def hint():
                    return _diagnose_broadcast(got, numel, src, seg, rank, n)

                _expect_values(ex, got, want, rank=rank, n=n, hint=hint,
                               what=f"the tensor after broadcasting {numel} elements from "
                                    f"rank {src} in {seg} segment(s) (before it, rank i "
                                    f"held 1000i + j)")
            for rank, (got, want, stats, events) in enumerate(per_rank):
                pos = (rank - src) % n
                if n > 1:
                    _expect_peers(ex, stats, rank=rank, n=n, hint=peer_hint,
                                  sent={(rank + 1) % n} if pos < n - 1 else set(),
                                  received={(rank - 1) % n} if pos > 0 else set())
                if numel < seg:
                    continue  # whether empty segments are sent is up to you
                want_msgs = (seg if pos < n - 1 else 0, seg if pos > 0 else 0)
                checks.expect_equal(ex, (stats["sent_messages"], stats["recv_messages"]),
                                    want_msgs if n > 1 else (0, 0), rank=rank, world_size=n,
                                    what=f"(messages sent, received) with src={src}, S={seg}",
                                    hint="each rank receives every segment from its left "
                                         "neighbour and forwards it right, except the last "
                                         "rank of the chain, (src - 1) % n")
                if 0 < pos < n - 1:
                    _expect_pipelined(ex, events, rank=rank, n=n, src=src, seg=seg, pos=pos)
    checks.passed(ex, f"world sizes {list(world_sizes)}, sizes {sizes}, 1 and 4 segments, "
                      "each segment forwarded before the next arrives")
