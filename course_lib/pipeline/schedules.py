"""Pipeline schedules as data: which action each stage runs, in which order.

A schedule for p stages and m microbatches is ``list[list[Action]]``: entry s
is stage s's actions in execution order. ``Action("F", 3)`` is the forward of
microbatch 3, ``Action("B", 3)`` its backward; ``"W"`` is reserved for
zero-bubble schedules, which split a backward into B (gradient of the input,
needed upstream at once) and W (gradient of the weights, which can wait).
``chunk`` is the model chunk for interleaved ("looped") schedules, where stage
s holds virtual stages s, s + p, ..., s + (v-1)p.

    sched = one_f_one_b(p=4, m=8)
    sched[3][:4]        # [F0, B0, F1, B1]: the last stage alternates at once
    validate(sched, 4, 8)

Because a schedule is plain data it can be checked (:func:`validate`), timed
(:func:`course_lib.pipeline.simulate.simulate`) and drawn before anything runs.
"""
from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F", "B" or "W"
    microbatch: int
    chunk: int = 0

    def __repr__(self):
        return f"{self.kind}{self.microbatch}" + (f"@{self.chunk}" if self.chunk else "")


KINDS = ("F", "B", "W")


def _check_sizes(p, m, v=1):
    for name, value in (("p (stages)", p), ("m (microbatches)", m), ("v (chunks)", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def naive(p):
    """Model parallelism without pipelining: one microbatch, the whole batch."""
    return gpipe(p, 1)


def gpipe(p, m):
    """GPipe: every stage runs all m forwards, then all m backwards.

    Bubble (p-1)/(m+p-1) with balanced stages; every stage holds the
    activations of all m microbatches before the first backward."""
    _check_sizes(p, m)
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
            for _ in range(p)]


def one_f_one_b(p, m):
    """1F1B (PipeDream-flush): stage s warms up with min(p-s-1, m) forwards, then
    alternates one forward and one backward, then drains the backwards left.

    Same bubble as GPipe, (p-1)/(m+p-1), but stage s never holds more than
    min(m, p-s) microbatches of activations, instead of m."""
    _check_sizes(p, m)
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", i) for i in range(m - warmup, m)]
        schedule.append(actions)
    return schedule


def interleaved_1f1b(p, m, v):
    """Interleaved 1F1B (Megatron-LM's looped schedule): stage s holds v model
    chunks, virtual stages s, s+p, ..., s+(v-1)p, each 1/v of its layers.

    Microbatches go through in groups of p; stage s warms up with
    2(p-s-1) + (v-1)p chunk-forwards. With chunk times t_f/v and t_b/v the
    bubble is (p-1)/(vm+p-1): v times smaller, for v times the messages.
    Needs m to be a multiple of p (as Megatron does)."""
    _check_sizes(p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        raise ValueError(f"interleaved 1F1B runs microbatches in groups of p: m={m} must be "
                         f"a multiple of p={p}")
    total = m * v

    def unit(k, forward):
        group, within = divmod(k, p * v)
        chunk = within // p
        return (group * p + within % p, chunk if forward else v - 1 - chunk)

    schedule = []
    for s in range(p):
        warmup = min(2 * (p - s - 1) + (v - 1) * p, total)
        actions = [Action("F", *unit(k, True)) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [Action("F", *unit(warmup + k, True)), Action("B", *unit(k, False))]
        actions += [Action("B", *unit(k, False)) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


def zb_h1(p, m):
    """ZB-H1 (zero bubble, "handcrafted 1"): 1F1B's order of F and B, with each
    backward split into B (input gradient) and W (weight gradient), and stage s
    holding back its first s W's to fill the cool-down, where 1F1B idles.

    With t_F = t_B = t_W the bubble is a third of 1F1B's, and no stage holds
    more than p microbatches (until their W), as 1F1B's first stage does."""
    _check_sizes(p, m)
    schedule = []
    for s, actions in enumerate(one_f_one_b(p, m)):
        out, waiting = [], []
        delay = min(s, m)  # W's stage s keeps back before its first W
        for action in actions:
            out.append(action)
            if action.kind == "B":
                waiting.append(action.microbatch)
                if len(waiting) > delay:
                    out.append(Action("W", waiting.pop(0)))
        out += [Action("W", i) for i in waiting]
        schedule.append(out)
    return schedule


SCHEDULES = {"naive": lambda p, m, v=1: naive(p), "gpipe": lambda p, m, v=1: gpipe(p, m),
             "1f1b": lambda p, m, v=1: one_f_one_b(p, m), "interleaved": interleaved_1f1b,
             "zb-h1": lambda p, m, v=1: zb_h1(p, m)}


def make_schedule(kind, p, m, v=1):
    """A schedule by name: one of :data:`SCHEDULES` ("naive" ignores m)."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {list(SCHEDULES)}")
    return SCHEDULES[kind](p, m, v)


# ---- validation ------------------------------------------------------------------------
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
