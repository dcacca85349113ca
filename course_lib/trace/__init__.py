"""Per-rank timelines: spans recorded on each rank, merged on one clock, measured and drawn.

- :mod:`~course_lib.trace.spans`: ``span``, ``async_span``, the per-rank recorder
- :mod:`~course_lib.trace.timeline`: :class:`Trace` (all ranks), Chrome JSON
- :mod:`~course_lib.trace.metrics`: busy, overlap fractions on unions of intervals
- :mod:`~course_lib.trace.gantt`: the matplotlib Gantt chart
"""
from course_lib.trace.metrics import busy_fraction, busy_table, overlap_fraction
from course_lib.trace.spans import (CATEGORIES, Span, Tracer, async_span, finish, get_tracer,
                                    paused, span, start, trace_backward)
from course_lib.trace.timeline import Trace, lanes_of

__all__ = ["CATEGORIES", "Span", "Tracer", "Trace", "span", "async_span", "start", "finish",
           "get_tracer", "paused", "trace_backward", "lanes_of", "busy_fraction", "busy_table", "overlap_fraction"]
