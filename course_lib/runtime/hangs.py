"""What kind of hang a job's stacks show, and a hint aimed at it.

:func:`diagnose_hang` takes every rank's stack dump (rank -> text; a rank
missing had exited) and tells ranks stuck in different collectives from a rank
missing from a collective, unmatched sends and receives, ranks still computing
or still starting; :class:`HangDiagnosis` words it for the student. A pure
function: it is tested on hand-written dumps.
"""
from __future__ import annotations

import linecache
from dataclasses import dataclass

from course_lib.runtime.stacks import RankState, rank_state, ranks_phrase


@dataclass
class HangDiagnosis:
    """What a hung job's stacks say (:func:`diagnose_hang`).

    ``kind``: ``mismatched-collectives`` (ranks wait in different collectives),
    ``missing-from-collective`` (some ranks wait in a collective that others never
    joined: they returned, exited, or wait in something else), ``same-collective``
    (every rank waits in the same collective, which still does not complete),
    ``p2p`` (sends and receives that do not pair up, no collective involved),
    ``busy`` (no rank waits for a message: still computing), ``in-check`` (ranks
    only in the checker's own code), ``starting`` (no rank had reached the
    function), ``no-stacks``. ``ranks`` maps rank -> :class:`RankState`; ``hint``
    is one paragraph for the student."""
    kind: str
    ranks: dict
    hint: str

    def summary(self):
        """One line per group of ranks in the same place."""
        groups = {}
        for state in self.ranks.values():
            groups.setdefault(state.describe(plural=True), []).append(state)
        lines = []
        for states in groups.values():
            many = len(states) > 1
            lines.append(f"  {ranks_phrase([s.rank for s in states])} {states[0].describe(many)}")
        return "\n".join(lines)

    def explain(self):
        """The summary, the hint and every rank's trimmed stack."""
        parts = [self.summary(), f"Hint: {self.hint}",
                 "Where each rank was, from your code to the call it waits in (most recent "
                 "call last; the full dumps are in the exception's .stacks):"]
        parts += [f"--- rank {r} ---\n{s.stack}" for r, s in sorted(self.ranks.items())]
        return "\n".join(parts)


_COLLECTIVE_RULE = ("A collective returns only when every rank of the group has called it, "
                    "and the ranks must call the same collectives in the same order")


def diagnose_hang(stacks, nproc, getline=linecache.getline):
    """Read the stacks of a job that hung (rank -> faulthandler dump; a rank missing
    had exited) and say what kind of hang it is, naming the ranks and the call each
    waits in. A pure function: ``getline(file, line)`` gives source lines to quote
    (the notebook kernel's linecache knows its cells)."""
    ranks = sorted(set(range(nproc)) | set(stacks))
    states = {r: rank_state(r, stacks[r], getline) if r in stacks else
              RankState(r, "exited", stack="  (no stack: the process had exited)")
              for r in ranks}
    kind, hint = _classify(list(states.values()))
    return HangDiagnosis(kind, states, hint)


def _by_op(states):
    """"rank 0 in all_reduce(), ranks 1 and 2 in broadcast()"."""
    groups = {}
    for s in states:
        groups.setdefault(s.op, []).append(s.rank)
    return ", ".join(f"{ranks_phrase(rs)} in {op}()" for op, rs in groups.items())


def _briefly(states):
    """"rank 1 had already returned from your function; rank 2 is in recv()"."""
    groups = {}
    for s in states:
        groups.setdefault(s.brief(plural=True), []).append(s)
    return "; ".join(f"{ranks_phrase([s.rank for s in g])} {g[0].brief(len(g) > 1)}"
                     for g in groups.values())


def _ops(states):
    """"recv()", "send() and recv()"."""
    names = sorted({f"{s.op}()" for s in states})
    return " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + f" and {names[-1]}"


def _wait(states, one="waits", many="wait"):
    return many if len(states) > 1 else one


def _classify(states):
    """``(kind, hint)`` for the :class:`RankState` of every rank."""
    blocked = [s for s in states if s.status == "blocked"]
    colls = [s for s in blocked if s.kind == "collective"]
    p2p = [s for s in blocked if s.kind != "collective"]
    busy = [s for s in states if s.status == "busy"]
    if all(s.status == "exited" for s in states):
        return "no-stacks", ("no rank answered with its stack: they had all exited, or had "
                             "not started yet (then the timeout was too short for this machine).")
    if colls:
        ops = sorted({s.op for s in colls})
        others = [s for s in states if s not in colls]
        if len(ops) > 1:
            also = f" Meanwhile {_briefly(others)}." if others else ""
            return "mismatched-collectives", (
                f"the ranks are stuck in different collectives: {_by_op(colls)}.{also} "
                f"{_COLLECTIVE_RULE}: look for a collective under an `if` on the rank, or "
                f"collectives called in a different order on different ranks.")
        op, waiting = ops[0], ranks_phrase([s.rank for s in colls])
        if others:
            return "missing-from-collective", (
                f"{waiting} {_wait(colls)} in {op}(), which {ranks_phrase([s.rank for s in others])} "
                f"never joined ({_briefly(others)}). {_COLLECTIVE_RULE}: look for an `if` on "
                f"the rank or an early `return` that lets some ranks skip it, or a loop that "
                f"runs a different number of times on some ranks.")
        places = {(s.caller.func, s.caller.line) for s in colls if s.caller is not None}
        where = ""
        if len(places) > 1:
            where = " They are at different calls: " + "; ".join(
                f"rank {s.rank}{s.at()}" for s in colls) + "."
        return "same-collective", (
            f"every rank waits in {op}(), and it still does not complete.{where} The ranks' "
            f"calls do not match: check that all of them pass the same process group (and "
            f"are members of it) and make the same calls in the same order (a rank can be a "
            f"call ahead of the others).")
    if p2p:
        waiting, ops = ranks_phrase([s.rank for s in p2p]), {s.op for s in p2p}
        both = ("both " if len(p2p) == 2 else "all ") if len(p2p) > 1 else ""
        left = [s for s in states if s.left] + busy
        if left:
            what = (f"{waiting} {_wait(p2p)} in {_ops(p2p)}, but {_briefly(left)}: no rank "
                    f"will match {'them' if len(p2p) > 1 else 'it'}"
                    + (" (one recv too many, or a send missing on the peer?)."
                       if ops <= {"recv", "wait"} else "."))
        elif ops <= {"recv"}:
            what = f"{waiting} {both}{_wait(p2p)} in recv() and no rank is sending."
        elif ops <= {"send"}:
            what = (f"{waiting} {both}{_wait(p2p)} in send() and no rank is receiving: on "
                    f"gloo a blocking send returns only once the peer has taken the message.")
        elif ops == {"wait"}:
            what = (f"{waiting} {both}{_wait(p2p)} in wait() for a message "
                    f"(an isend or irecv) that never completes.")
        else:
            what = f"no collective is involved: {_by_op(p2p)}, and these do not pair up."
        return "p2p", (
            f"{what} Look for a send or recv that no other rank matches: each send needs the "
            f"peer's recv, with matching peer ranks (a send to rank + 1 is received from "
            f"rank - 1) and tags, and two ranks that both receive first, or both send first, "
            f"deadlock: post one side non-blocking (isend/irecv) or use comm.exchange.")
    if busy:
        return "busy", (
            f"no rank waits for a message: {_briefly(busy)}. An endless loop, or work too "
            f"slow for the timeout (try a smaller input or a larger timeout)? On a GPU a rank "
            f"also waits in .item(), .cpu() or sync() when a collective or send it enqueued "
            f"never completes: NCCL calls only enqueue work.")
    if any(s.status == "in-check" for s in states):
        return "in-check", (
            f"no rank is in your code: {_briefly(states)}. The ranks left your function at "
            f"different points: compare the collectives each rank calls.")
    if any(s.status == "starting" for s in states):
        return "starting", (
            "no rank had reached your function: the job was still starting (importing "
            "torch, joining the process group). The timeout was too short for this machine.")
    return "unknown", f"{_briefly(states)}. Look for a send, recv or collective that not " \
                      f"every rank calls."
