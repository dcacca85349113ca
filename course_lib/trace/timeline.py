"""A merged timeline: every rank's spans on one clock, as Chrome JSON or a Gantt chart.

``run(...).trace`` is a :class:`Trace`; times are seconds since a common t0
taken right after a barrier (see :mod:`course_lib.trace.spans`).
"""
from __future__ import annotations

import json
from dataclasses import asdict

from course_lib.trace.spans import CATEGORIES, Span


class Trace:
    """Spans of all ranks on one clock (seconds since t0)."""

    def __init__(self, spans):
        self.spans = sorted(spans, key=lambda s: (s.rank, s.start, s.end))

    @classmethod
    def from_exports(cls, exports):
        """Merge per-rank exports. On one host ``perf_counter_ns`` is one clock, so
        every rank is shifted by the same t0 (the earliest); across hosts each rank
        is shifted by its own post-barrier t0."""
        same_host = len({e["host"] for e in exports}) == 1
        common = min(e["t0_ns"] for e in exports)
        spans = []
        for e in exports:
            t0 = common if same_host else e["t0_ns"]
            for s in e["spans"]:
                meta = {k: v for k, v in s.items() if k not in ("name", "cat", "start_ns", "end_ns")}
                known = {k: meta.pop(k) for k in ("microbatch", "bytes", "peer") if k in meta}
                spans.append(Span(e["rank"], s["name"], s["cat"], (s["start_ns"] - t0) / 1e9,
                                  (s["end_ns"] - t0) / 1e9, args=meta, **known))
        return cls(spans)

    @property
    def ranks(self):
        return sorted({s.rank for s in self.spans})

    @property
    def start(self):
        return min((s.start for s in self.spans), default=0.0)

    @property
    def end(self):
        return max((s.end for s in self.spans), default=0.0)

    def select(self, rank=None, cat=None, name=None):
        return [s for s in self.spans if (rank is None or s.rank == rank)
                and (cat is None or s.cat == cat) and (name is None or s.name == name)]

    def to_chrome(self, path=None):
        """Chrome trace JSON (opens in Perfetto): one pid per rank, one named lane
        (tid) per category, extra lanes where spans of a category overlap."""
        events = []
        lanes = {}
        for rank in self.ranks:
            events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                           "args": {"name": f"rank {rank}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                           "args": {"sort_index": rank}})
            for lane_name, tid, spans in lanes_of(self.select(rank=rank)):
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                               "args": {"name": lane_name}})
                for s in spans:
                    lanes[id(s)] = tid
        for s in self.spans:
            args = {k: v for k, v in asdict(s).items()
                    if k in ("microbatch", "bytes", "peer") and v is not None}
            args.update(s.args)
            events.append({"name": s.name, "cat": s.cat, "ph": "X", "ts": s.start * 1e6,
                           "dur": s.duration * 1e6, "pid": s.rank, "tid": lanes[id(s)],
                           "args": args})
        doc = {"traceEvents": events, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w") as f:
                json.dump(doc, f)
        return doc

    def plot(self, ax=None, **kwargs):
        from course_lib.trace.gantt import gantt

        return gantt(self, ax=ax, **kwargs)


def lanes_of(spans):
    """Split one rank's spans into lanes ``(name, tid, spans)``: one lane per
    category in :data:`CATEGORIES` order, plus ``cat #2``... lanes wherever spans
    of a category overlap without nesting (asynchronous operations). Greedy
    interval partitioning, so the number of lanes is the peak concurrency."""
    order = {c: i for i, c in enumerate(CATEGORIES)}
    out, tid = [], 1
    for cat in sorted({s.cat for s in spans}, key=lambda c: (order.get(c, len(order)), c)):
        rows = []  # each row: list of spans, last end
        for s in sorted((s for s in spans if s.cat == cat), key=lambda s: (s.start, -s.end)):
            for row in rows:
                last = row[-1]
                if s.start >= last.end or (s.start >= last.start and s.end <= last.end):
                    row.append(s)
                    break
            else:
                rows.append([s])
        for i, row in enumerate(rows):
            out.append((cat if i == 0 else f"{cat} #{i + 1}", tid, row))
            tid += 1
    return out
