"""Numbers measured from a :class:`~course_lib.trace.Trace`.

All are computed on unions of intervals, so overlapping spans (several
asynchronous all-reduces in flight at once) are never counted twice.

- ``busy_fraction(trace, rank, cat)``: |U(cat on rank)| / |window|.
- ``overlap_fraction(trace, a="comm", b="compute")``: |U(a) ∩ U(b)| / |U(a)|,
  "how much of the communication ran while computation ran" (1.0 = fully hidden).
"""
from __future__ import annotations


def union(intervals):
    """Sorted disjoint intervals covering the same points as ``intervals``."""
    merged = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(iv) for iv in merged]


def total(intervals):
    return sum(end - start for start, end in union(intervals))


def intersect(a, b):
    """Intersection of two interval sets, as disjoint intervals."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(intervals, window):
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


def _intervals(trace, rank, cat):
    return [(s.start, s.end) for s in trace.select(rank=rank, cat=cat)]


def window_of(trace, rank=None):
    spans = trace.select(rank=rank)
    if not spans:
        raise ValueError(f"no spans for rank {rank}" if rank is not None else "empty trace")
    return min(s.start for s in spans), max(s.end for s in spans)


def busy_fraction(trace, rank, cat=None, window=None):
    """Fraction of ``window`` (default: the whole trace) that ``rank`` spent in
    spans of category ``cat`` (any category if None)."""
    window = window or window_of(trace)
    length = window[1] - window[0]
    if length <= 0:
        return 0.0
    return total(clip(_intervals(trace, rank, cat), window)) / length


def busy_table(trace, window=None):
    """{rank: {category: busy fraction}} plus an ``idle`` entry per rank (time in
    no span at all)."""
    window = window or window_of(trace)
    cats = sorted({s.cat for s in trace.spans})
    table = {}
    for rank in trace.ranks:
        row = {cat: busy_fraction(trace, rank, cat, window) for cat in cats}
        row["idle"] = 1.0 - busy_fraction(trace, rank, None, window)
        table[rank] = row
    return table


def overlap_fraction(trace, a="comm", b="compute", rank=None):
    """|U(a) ∩ U(b)| / |U(a)| summed over ``rank`` (or all ranks); 0.0 when there
    is no ``a`` at all."""
    ranks = trace.ranks if rank is None else [rank]
    overlapped = span_a = 0.0
    for r in ranks:
        ia, ib = _intervals(trace, r, a), _intervals(trace, r, b)
        span_a += total(ia)
        overlapped += total(intersect(ia, ib))
    return overlapped / span_a if span_a > 0 else 0.0
