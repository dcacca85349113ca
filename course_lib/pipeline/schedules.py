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
    validate(sched, 4, 8)       # course_lib.pipeline.validate

Because a schedule is plain data it can be checked (:mod:`~course_lib.pipeline.validate`), timed
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
