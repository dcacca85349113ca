"""Checking a schedule before it runs (Lab 04): is it complete, ordered, deadlock-free?

A schedule (:mod:`course_lib.pipeline.schedules`) is plain data, so every property
the executor relies on can be checked without a process: :func:`validate` names
the first violation of completeness and order, :func:`deadlock` plays the
executor's message protocol and says where each stuck stage would wait.

    validate(one_f_one_b(4, 8), 4, 8)        # None: fine
    deadlock([[Action("B", 0), Action("F", 0)], ...])   # "stage 0 waits for ..."
"""
from __future__ import annotations

from course_lib.pipeline.schedules import KINDS, Action

def as_actions(schedule):
    """The schedule with every entry an :class:`Action` (plain ``(kind, mb)`` tuples allowed)."""
    return [[a if isinstance(a, Action) else Action(*a) for a in actions] for actions in schedule]


def chunks_of(schedule):
    """v: the number of model chunks a schedule uses (1 unless interleaved)."""
    return 1 + max((a[2] if len(a) > 2 else 0 for actions in schedule for a in actions),
                   default=0)


def validate(schedule, p, m):
    """Raise ValueError naming the first violation, else return None.

    Checked in this order: p lists of Actions with known kinds, microbatches in
    [0, m) and chunks in [0, v); each stage runs F and B of every (microbatch,
    chunk) exactly once (and W, if the schedule uses W, exactly once); B after F
    and W after B on the same stage; activations and gradients cross each link
    in the same microbatch order on both sides (messages between two stages
    arrive in the order they were sent: NCCL matches them by order alone), so
    F(mb) on stage s follows F(mb) on s-1 and B(mb) on s follows B(mb) on s+1;
    and the schedule runs to the end with each stage waiting only for its inputs
    (:func:`deadlock`; the executor also checks its own, stricter posting rule)."""
    if not isinstance(schedule, (list, tuple)) or len(schedule) != p:
        got = len(schedule) if isinstance(schedule, (list, tuple)) else type(schedule).__name__
        raise ValueError(f"a schedule for p={p} stages is a list of {p} lists of actions, "
                         f"got {got}")
    uses_w = False
    for s, actions in enumerate(schedule):
        if not isinstance(actions, (list, tuple)):
            raise ValueError(f"stage {s}: expected a list of actions, got {type(actions).__name__}")
        for i, a in enumerate(actions):
            if not isinstance(a, tuple) or len(a) not in (2, 3) or a[0] not in KINDS:
                raise ValueError(f"stage {s}, position {i}: {a!r} is not an Action(kind, "
                                 f"microbatch) with kind in {KINDS}")
            if not isinstance(a[1], int) or not 0 <= a[1] < m:
                raise ValueError(f"stage {s}, position {i}: {a!r} names microbatch {a[1]!r}, "
                                 f"outside [0, {m})")
            if len(a) == 3 and (not isinstance(a[2], int) or a[2] < 0):
                raise ValueError(f"stage {s}, position {i}: {a!r} has chunk {a[2]!r}")
            uses_w |= a[0] == "W"
    schedule = as_actions(schedule)
    v = chunks_of(schedule)
    for s, actions in enumerate(schedule):
        _check_stage(s, actions, m, v, uses_w)
    _check_link_order(schedule, p, v)
    stuck = deadlock(schedule)
    if stuck:
        raise ValueError(f"the schedule deadlocks: {stuck}")


def _check_stage(s, actions, m, v, uses_w):
    seen = {}
    for i, a in enumerate(actions):
        a = Action(*a)
        if a in seen:
            raise ValueError(f"stage {s}: {a!r} runs twice (positions {seen[a]} and {i})")
        seen[a] = i
        earlier = {"B": "F", "W": "B"}.get(a.kind)
        if earlier and Action(earlier, a.microbatch, a.chunk) not in seen:
            raise ValueError(f"stage {s}, position {i}: {a!r} runs before "
                             f"{Action(earlier, a.microbatch, a.chunk)!r} (a backward needs its "
                             f"forward's activations; W needs B first)")
    for kind in ("F", "B", "W") if uses_w else ("F", "B"):
        for c in range(v):
            for mb in range(m):
                if Action(kind, mb, c) not in seen:
                    raise ValueError(f"stage {s}: {Action(kind, mb, c)!r} never runs")


def _check_link_order(schedule, p, v):
    """F order on each virtual stage equals its predecessor's; B order equals its successor's."""
    order = {}  # (kind, virtual stage) -> microbatches in the order that stage runs them
    for s, actions in enumerate(schedule):
        for a in actions:
            order.setdefault((a[0], a[2] * p + s), []).append(a[1])
    last = v * p - 1
    for vs in range(1, last + 1):
        sent, got = order[("F", vs - 1)], order[("F", vs)]
        if sent != got:
            first = next(i for i, (x, y) in enumerate(zip(sent, got)) if x != y)
            raise ValueError(
                f"stage {vs % p} runs F{got[first]}{_at(vs, p)} where stage {(vs - 1) % p} sent "
                f"F{sent[first]}'s activation (position {first} of the forwards on that link): "
                f"F(mb) must follow F(mb) on the stage before, and messages on a link arrive in "
                f"the order sent, so both stages must run the forwards in the same order "
                f"({sent} vs {got})")
    for vs in range(last):
        sent, got = order[("B", vs + 1)], order[("B", vs)]
        if sent != got:
            first = next(i for i, (x, y) in enumerate(zip(sent, got)) if x != y)
            raise ValueError(
                f"stage {vs % p} runs B{got[first]}{_at(vs, p)} where stage {(vs + 1) % p} sent "
                f"B{sent[first]}'s gradient (position {first} of the backwards on that link): "
                f"B(mb) must follow B(mb) on the stage after, in the same order on both stages "
                f"({sent} vs {got})")


def _at(vs, p):
    return f"@{vs // p}" if vs >= p else ""


def messages_of(action, stage, p, v):
    """(receives before, sends after) ``action`` on ``stage``, as message keys
    ``(what, microbatch, to virtual stage)``; transfers within one stage are
    not messages."""
    kind, mb, chunk = action
    vs, last = chunk * p + stage, v * p - 1
    recvs, sends = [], []
    if kind == "F":
        if vs > 0 and (vs - 1) % p != stage:
            recvs.append(("act", mb, vs))
        if vs < last and (vs + 1) % p != stage:
            sends.append(("act", mb, vs + 1))
    elif kind == "B":
        if vs < last and (vs + 1) % p != stage:
            recvs.append(("grad", mb, vs))
        if vs > 0 and (vs - 1) % p != stage:
            sends.append(("grad", mb, vs - 1))
    return recvs, sends


def deadlock(schedule, rendezvous=False):
    """None if ``schedule`` runs to the end, else a sentence saying where each
    stuck stage waits.

    Each stage posts the receives its first action needs; after each action it
    posts, as one exchange, that action's sends together with the next action's
    receives (the executor's protocol, :mod:`course_lib.pipeline.executor`),
    and runs the next action once the exchange is done. By default a send is
    done once posted (the data is on its way), so a stage waits only for its
    inputs: the schedule's own dependencies. ``rendezvous=True`` makes a send
    wait until the receiver has posted its receive too, the strictest reading
    of gloo and NCCL: what the executor needs to be safe on both."""
    schedule = as_actions(schedule)
    p, v = len(schedule), chunks_of(schedule)
    exchanges = []  # per stage: [(recv keys, send keys)] before action 0, 1, ..., after the last
    for s, actions in enumerate(schedule):
        per = [messages_of(a, s, p, v) for a in actions]
        stage_ex = [(per[0][0] if per else [], [])]
        for i in range(len(actions)):
            stage_ex.append((per[i + 1][0] if i + 1 < len(actions) else [], per[i][1]))
        exchanges.append(stage_ex)
    posted_recv, posted_send = set(), set()
    done = [0] * p  # stage s has completed exchanges[s][:done[s]]
    posted = [False] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while done[s] < len(exchanges[s]):
                recvs, sends = exchanges[s][done[s]]
                if not posted[s]:
                    posted_recv.update(recvs)
                    posted_send.update(sends)
                    posted[s] = progress = True
                if not (all(k in posted_send for k in recvs)
                        and (not rendezvous or all(k in posted_recv for k in sends))):
                    break
                done[s] += 1
                posted[s] = False
                progress = True
    stuck = [s for s in range(p) if done[s] < len(exchanges[s])]
    if not stuck:
        return None
    waits = []
    for s in stuck:
        recvs, sends = exchanges[s][done[s]]
        nxt = schedule[s][done[s]] if done[s] < len(schedule[s]) else None
        where = f"before {Action(*nxt)!r}" if nxt else "after its last action"
        for what, mb, to in recvs:
            if (what, mb, to) in posted_send:
                continue
            if what == "act":
                waits.append(f"stage {s} waits {where} for F{mb}{_at(to - 1, p)}'s activation "
                             f"from stage {(to - 1) % p}")
            else:
                waits.append(f"stage {s} waits {where} for B{mb}{_at(to + 1, p)}'s gradient "
                             f"from stage {(to + 1) % p}")
        for what, mb, to in sends if rendezvous else ():
            if (what, mb, to) not in posted_recv:
                noun = "activation" if what == "act" else "gradient"
                waits.append(f"stage {s} waits {where} for stage {to % p} to take the {noun} "
                             f"it sent")
    return "; ".join(waits)
