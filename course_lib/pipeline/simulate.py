"""Timing a schedule without running it: start and end of every action, and the bubble.

Every forward takes t_f, every backward t_b (t_b ~ 2 t_f: a backward computes
the gradients of both the input and the weights), and a message between two
stages t_comm. An action starts when its stage is free and its input is
there: F(mb) on stage s needs F(mb) from stage s-1, B(mb) needs B(mb) from
stage s+1 (on the last stage, its own F(mb)). The result is the ideal run of
the schedule; the executor's measured timeline comes close to it when stages
are balanced.

    sim = simulate(gpipe(4, 8))
    sim.bubble, bubble_fraction(4, 8)         # both (p-1)/(m+p-1) = 3/11

The bubble is the idle fraction of the p stages over the makespan,
idle / (p * makespan). With interleaving (v chunks per stage) a chunk's action
takes t_f/v or t_b/v; with zero-bubble schedules a backward is split into B
(t_b - t_w) and W (t_w).
"""
from __future__ import annotations

from dataclasses import dataclass

from course_lib.pipeline.schedules import Action
from course_lib.pipeline.validate import as_actions, chunks_of, validate


def bubble_fraction(p, m, v=1):
    """(p-1)/(vm+p-1): GPipe's and 1F1B's bubble (v=1), interleaved 1F1B's with v chunks."""
    return (p - 1) / (v * m + p - 1)


def zb_h1_bubble(p, m, t_f=1.0, t_b=2.0, t_w=1.0):
    """ZB-H1's bubble with B = t_b - t_w and W = t_w: the idle time per stage
    shrinks from 1F1B's (p-1)(t_f + t_b) to (p-1)(t_f + t_b - 2 t_w)."""
    idle = (p - 1) * (t_f + t_b - 2 * t_w)
    return idle / (m * (t_f + t_b) + idle)


@dataclass
class Simulation:
    """``timeline[s]`` is stage s's [(action, start, end)] in execution order."""
    p: int
    m: int
    v: int
    timeline: list
    makespan: float
    busy: list  # per stage, time spent computing

    @property
    def bubble(self):
        """idle / (p * makespan)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.p * self.makespan)

    def start_of(self, stage, action):
        return next(t0 for a, t0, _ in self.timeline[stage] if a == action)

    def end_of(self, stage, action):
        return next(t1 for a, _, t1 in self.timeline[stage] if a == action)


def simulate(schedule, t_f=1.0, t_b=2.0, t_comm=0.0, t_w=None, m=None):
    """Run ``schedule`` on an ideal machine; returns a :class:`Simulation`.

    ``t_w`` (default t_b/2) is the weight-gradient part of t_b, used only for
    schedules with W actions. ``m`` defaults to the largest microbatch + 1.
    Raises ValueError (from :func:`validate`) for a schedule that cannot run."""
    p, v = len(schedule), chunks_of(schedule)
    if m is None:
        m = 1 + max((a[1] for actions in schedule for a in actions), default=0)
    validate(schedule, p, m)
    schedule = as_actions(schedule)
    t_w = t_b / 2 if t_w is None else t_w
    if not 0 <= t_w <= t_b:
        raise ValueError(f"t_w={t_w} must lie in [0, t_b={t_b}]: W is part of the backward")
    split = {(a[1], a[2]) for actions in schedule for a in actions if a[0] == "W"}
    last = v * p - 1
    ends = {}  # (kind, microbatch, virtual stage) -> end time
    timeline = [[] for _ in range(p)]
    free = [0.0] * p
    nxt = [0] * p
    remaining = sum(len(actions) for actions in schedule)
    while remaining:
        moved = False
        for s in range(p):
            while nxt[s] < len(schedule[s]):
                kind, mb, chunk = schedule[s][nxt[s]]
                vs = chunk * p + s
                if kind == "F":
                    dep = ("F", mb, vs - 1) if vs > 0 else None
                    cross = vs > 0 and (vs - 1) % p != s
                    duration = t_f / v
                elif kind == "B":
                    dep = ("B", mb, vs + 1) if vs < last else ("F", mb, vs)
                    cross = vs < last and (vs + 1) % p != s
                    duration = (t_b - t_w if (mb, chunk) in split else t_b) / v
                else:
                    dep, cross, duration = ("B", mb, vs), False, t_w / v
                if dep is not None and dep not in ends:
                    break
                ready = 0.0 if dep is None else ends[dep] + (t_comm if cross else 0.0)
                start = max(free[s], ready)
                free[s] = ends[(kind, mb, vs)] = start + duration
                timeline[s].append((Action(kind, mb, chunk), start, start + duration))
                nxt[s] += 1
                remaining -= 1
                moved = True
        if not moved:  # validate() rules this out; kept so a bug cannot loop forever
            raise RuntimeError("simulation made no progress")
    makespan = max(free) if p else 0.0
    busy = [sum(t1 - t0 for _, t0, t1 in row) for row in timeline]
    return Simulation(p, m, v, timeline, makespan, busy)


def peak_in_flight(schedule):
    """Per stage, the most microbatches whose forward has run and whose backward
    has not (with W actions: whose W has not, since W still needs the layer
    inputs). Activation memory of stage s is about this many microbatches'.

    GPipe: m on every stage. 1F1B: min(m, p-s) on stage s."""
    schedule = as_actions(schedule)
    uses_w = any(a.kind == "W" for actions in schedule for a in actions)
    release = "W" if uses_w else "B"
    peaks = []
    for actions in schedule:
        held = peak = 0
        for kind, _, _ in actions:
            if kind == "F":
                held += 1
                peak = max(peak, held)
            elif kind == release:
                held -= 1
        peaks.append(peak)
    return peaks


def weight_versions(schedule):
    """What PipeDream without a flush would do with ``schedule``: every backward
    updates the stage's weights at once. Per stage, {microbatch: (version its
    forward used, version current at its backward)}, a version being the
    number of updates so far on that stage. Their difference is the staleness
    weight stashing hides (the backward reuses the forward's version): p-s-1
    updates on stage s in 1F1B's steady state."""
    out = []
    for actions in as_actions(schedule):
        updates, seen = 0, {}
        for kind, mb, _ in actions:
            if kind == "F":
                seen[mb] = [updates, None]
            elif kind == "B":
                seen[mb][1] = updates
                updates += 1
        out.append({mb: tuple(v) for mb, v in seen.items()})
    return out
