"""What Lab 01's checks tell a student: the hints, and diagnoses of wrong answers.

A wrong result is compared, in the check's process, with the likely mistakes
worked out from the inputs the check chose (an ignored ``op``, a chunk off by
one, a rank left out, a segment that never arrived...), and the hint says
which one it looks like; traffic that goes to the wrong ranks is named the
same way (the direction reversed, everything straight to its owner).
"""
from __future__ import annotations

from itertools import combinations

import torch

from course_lib.collectives.reduce_ops import chunk_bounds
from course_lib.grading.lab01.references import MAX, SUM, UNWRITTEN, chunks, reduce
from course_lib.grading.message_order import received_before_each_send

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
NAIVE_HINT = ("rank 0 receives every other rank's tensor into a scratch buffer, folds each into "
              "its own with combine(tensor, incoming, op), then sends the result to every other "
              "rank, which receives it into its `tensor`.")
NAIVE_PEERS_HINT = ("every other rank sends its tensor to rank 0 and receives the result from "
                    "rank 0; rank 0 receives from and sends to each of the others once.")
NAIVE_MESSAGES_HINT = ("every other rank sends its tensor to rank 0 and receives the result "
                       "back; rank 0 receives n-1 and sends n-1")
RING_ALL_REDUCE_HINT = ("copy the flattened tensor into a zero-padded buffer of K * ceil(N/K) "
                        "elements, reduce-scatter it (with `op`) into a chunk of ceil(N/K), "
                        "all-gather the chunks back into the buffer and copy its first N "
                        "elements into `tensor`.")
RING_CHUNK_BYTES_HINT = "each of the 2(n-1) messages should carry one chunk of about N/n bytes"
RING_MESSAGES_HINT = "reduce-scatter (n-1 steps) then all-gather (n-1 steps)"
CHAIN_PEERS_HINT = ("in a chain broadcast each rank receives from its left neighbour, "
                    "(rank - 1) % K, and forwards to its right, (rank + 1) % K; the source "
                    "only sends and the last rank, (src - 1) % K, only receives.")
CHAIN_MESSAGES_HINT = ("each rank receives every segment from its left neighbour and forwards "
                       "it right, except the last rank of the chain, (src - 1) % n")


def op_name(op):
    return OP_NAMES.get(op, str(op))


def describe_case(numel, dtype, op, patterned, rank_pattern):
    dt = str(dtype).replace("torch.", "")
    text = f"{numel} elements of {dt}" + (f", op {op_name(op)}" if op is not None else "")
    return text + (f" (inputs: {rank_pattern})" if patterned else "")


def same(got, want, n=1):
    """Does ``got`` equal ``want`` (to the checks' tolerance for ``n`` ranks)?"""
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and got.dtype == want.dtype
            and torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-5 * n))


def _head(t, limit=4):
    text = str(t[:limit].tolist())
    return text if t.numel() <= limit else text[:-1] + ", ...]"


# ---- who a rank talked to ------------------------------------------------------------------
def ring_peer_hint(kind):
    """The hint for a ring ``kind`` whose rank talked to the wrong ranks: a function of
    (what: "sent to" or "received from", the peers it had, rank, world size)."""
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


# ---- what a wrong result looks like --------------------------------------------------------
def diagnose_all_reduce(got, op, rank, inputs, otherwise):
    """A hint naming what ``got`` looks like (``inputs``: every rank's), or ``otherwise``."""
    n = len(inputs)
    if op != SUM and same(got, reduce(inputs, SUM), n):
        return (f"that is the SUM of the inputs, but op was {op_name(op)}: your code ignores "
                "`op`. Pass it on wherever you combine: combine(tensor, incoming, op).")
    if same(got, inputs[rank]):
        return (f"rank {rank} still holds its own input: nothing arrived from the other ranks "
                "(or it arrived in a buffer you did not copy back into `tensor`).")
    for size in range(1, n):
        for subset in combinations(range(n), size):
            if same(got, reduce([inputs[r] for r in subset], op), n):
                missing = sorted(set(range(n)) - set(subset))
                return (f"that is the {op_name(op)} of the inputs of ranks {list(subset)} only: "
                        f"rank(s) {missing} are missing. Did rank 0 receive into its own tensor, "
                        "overwriting it, instead of into a scratch buffer folded in with combine?"
                        if size == 1 else
                        f"that is the {op_name(op)} of the inputs of ranks {list(subset)} only: "
                        f"the contribution of rank(s) {missing} is missing.")
    return otherwise


def diagnose_reduce_scatter(got, inputs, op, rank, numel):
    """What a wrong reduce-scatter output of ``rank`` holds (``inputs``: every rank's)."""
    world = len(inputs)
    full, own = chunks(reduce(inputs, op), numel), chunks(inputs[rank], numel)
    if op != SUM and same(got, chunks(reduce(inputs, SUM), numel)[rank], world):
        return (f"that is the SUM of chunk {rank}, but op was {op_name(op)}: your code ignores "
                "`op`. Pass it on wherever you combine: combine(incoming, chunk(c), op).")
    for c in range(world):
        if c != rank and same(got, full[c], world):
            return (f"that is the complete reduction of chunk {c}, not of chunk {rank}: your "
                    f"chunk indices are off by {(c - rank) % world} (mod K). {RS_CHUNK_HINT}")
    if got.numel() > 1 and bool((got == UNWRITTEN).all()):
        return (f"output still holds {UNWRITTEN}s, what it held before your call: copy the "
                "partial you hold after the last step into it.")
    for c in range(world):
        if same(got, own[c]):
            return (f"that is chunk {c} of rank {rank}'s own input, with nothing from the other "
                    f"ranks folded in. {RS_CHUNK_HINT}")
    shown = "; ".join(f"chunk {c}: {_head(full[c])}" for c in range(world))
    return (f"it matches no chunk's reduction (the reductions are {shown}), so partial "
            f"results of different chunks got mixed. {RS_CHUNK_HINT}")


def diagnose_all_gather(got, want, world, numel):
    """Which rank's input each chunk of a wrong all-gather output holds."""
    held = []
    for piece in chunks(got, numel):
        owners = [k for k, w in enumerate(chunks(want, numel)) if same(piece, w)]
        if owners:
            held.append(f"rank {owners[0]}'s input")
        elif bool((piece == UNWRITTEN).all()):
            held.append(f"only {UNWRITTEN}s, what output held before your call")
        else:
            held.append("no rank's input")
    wrong = [c for c in range(world) if held[c] != f"rank {c}'s input"]
    where = ", ".join(f"chunk {c} holds {held[c]}" for c in wrong)
    return (f"chunk c of the output must hold rank c's input; here {where}. {AG_CHUNK_HINT}")


def diagnose_broadcast(got, inputs, src, seg, rank):
    """Say what each segment of a wrong broadcast result holds, and what that points to
    (``inputs``: what every rank held before the broadcast)."""
    n, numel = len(inputs), inputs[src].numel()
    bounds = [b for b in chunk_bounds(numel, seg) if b[1] > b[0]]
    if not isinstance(got, torch.Tensor) or got.shape != (numel,):
        return ("broadcast in place: write every segment into `tensor` itself (through "
                "views such as tensor[lo:hi]) and return it.")
    own, missing, foreign, moved = [], [], [], []
    for j, (lo, hi) in enumerate(bounds):
        piece = got[lo:hi]
        if same(piece, inputs[src][lo:hi]):
            continue
        if rank != src and same(piece, inputs[rank][lo:hi]):
            own.append(j)
            continue
        others = [q for q in range(n) if q not in (src, rank) and same(piece, inputs[q][lo:hi])]
        if others:
            foreign.append((j, others[0]))
            continue
        sources = [i for i, (a, b) in enumerate(bounds)
                   if b - a == hi - lo and same(piece, inputs[src][a:b])]
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


def held_back(events, seg):
    """Why a rank in the middle of a chain is not pipelined (it did not forward segment s
    before it received s+1), from the order of its messages; None when it is."""
    before = received_before_each_send(events)
    late = [s for s, got in enumerate(before) if got > s + 1]
    if not late:
        return None
    s = late[0]
    if before[0] >= seg:
        return ("forwarded nothing until it had received all "
                f"{seg} segments: that is store-and-forward, (K-1)(alpha + N/B) in all, "
                "however many segments you cut")
    return (f"had received {before[s]} of its {seg} segments before it forwarded segment "
            f"{s}, so each hop holds segments back")
