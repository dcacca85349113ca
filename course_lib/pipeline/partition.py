"""Cutting a model's layers into p contiguous stages so that the slowest stage is fast.

A pipeline runs at the pace of its slowest stage: with stage times c_0..c_{p-1}
a balanced schedule's step takes about (m + p - 1) * max(c_s). PipeDream profiles
each layer (forward + backward time, or a proxy such as FLOPs) and picks the
cut points by dynamic programming. Without stage replication and ignoring the
cost of the messages, that is

    best(k, j) = min over i < j of max(best(k-1, i), cost(i..j))

the lowest bottleneck for the first j layers on k stages. O(p n^2) time.

    partition([4, 1, 1, 1, 1, 4], 3)   # [range(0, 1), range(1, 5), range(5, 6)]: 4, 4, 4
"""
from __future__ import annotations

from itertools import combinations


def _check(layer_costs, p):
    costs = list(layer_costs)
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise ValueError(f"p must be a positive number of stages, got {p!r}")
    if len(costs) < p:
        raise ValueError(f"cannot cut {len(costs)} layers into {p} non-empty stages")
    for i, c in enumerate(costs):
        if not isinstance(c, (int, float)) or c != c or c < 0:
            raise ValueError(f"layer {i}'s cost must be a number >= 0, got {c!r}")
    return costs


def stage_costs(layer_costs, ranges):
    """The total cost of each stage."""
    costs = list(layer_costs)
    return [sum(costs[i] for i in r) for r in ranges]


def bottleneck(layer_costs, ranges):
    """The slowest stage's cost: what a partition is judged by."""
    return max(stage_costs(layer_costs, ranges))


def check_ranges(ranges, n, p):
    """ValueError unless ``ranges`` are p non-empty contiguous ranges covering 0..n-1 in order."""
    ranges = list(ranges)
    if len(ranges) != p:
        raise ValueError(f"expected {p} ranges, got {len(ranges)}")
    at = 0
    for s, r in enumerate(ranges):
        if not isinstance(r, range) or r.step != 1:
            raise ValueError(f"stage {s}: expected a range(start, end), got {r!r}")
        if r.start != at:
            raise ValueError(f"stage {s} starts at layer {r.start}, expected {at} (stages must "
                             f"be contiguous and cover every layer once, in order)")
        if len(r) == 0:
            raise ValueError(f"stage {s} is empty ({r!r}): every stage needs a layer")
        at = r.stop
    if at != n:
        raise ValueError(f"the stages end at layer {at}, but there are {n} layers")


def partition(layer_costs, p):
    """p contiguous, non-empty ``range``s of layer indices minimising the largest
    stage cost (ties: the first minimum the recursion meets)."""
    costs = _check(layer_costs, p)
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: lowest bottleneck of layers [0, j) on k stages; cut[k][j]: where stage k-1 starts
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    ranges, j = [], n
    for k in range(p, 0, -1):
        i = cut[k][j]
        ranges.append(range(i, j))
        j = i
    return ranges[::-1]


def partition_brute_force(layer_costs, p):
    """Every way to cut n layers into p non-empty contiguous stages, C(n-1, p-1) of
    them; the first with the lowest bottleneck. The reference for tests and checks."""
    costs = _check(layer_costs, p)
    n = len(costs)
    best, best_value = None, None
    for cuts in combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        ranges = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        value = bottleneck(costs, ranges)
        if best_value is None or value < best_value:
            best, best_value = ranges, value
    return best


def even_split(n, p):
    """p contiguous ranges of n layers, sizes differing by at most one (no costs)."""
    _check([0] * n, p)
    bounds = [s * n // p for s in range(p + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
