"""Per-rank timelines: record spans on each rank, merge them with aligned clocks.

On a rank (the launcher starts recording for you)::

    with trace.span("forward", "compute", microbatch=0):
        y = model(x)
    work = dist.all_reduce(g, async_op=True)
    trace.async_span("all_reduce", "comm", work, bytes=g.nbytes)  # ends on completion

In the notebook, ``run(...).trace`` is a :class:`Trace` over all ranks, with
times in seconds since a common t0 taken right after a barrier. Metrics
(busy and overlap fractions) live in :mod:`course_lib.trace.metrics`.
"""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

CATEGORIES = ("compute", "comm", "idle", "memory", "other")


@dataclass(frozen=True)
class Span:
    """One interval on one rank; ``start``/``end`` in seconds since the trace's t0."""
    rank: int
    name: str
    cat: str
    start: float
    end: float
    microbatch: int | None = None
    bytes: int | None = None
    peer: int | None = None
    args: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def duration(self):
        return self.end - self.start


class Tracer:
    """Records spans of one rank with ``time.perf_counter_ns`` (raw nanoseconds)."""

    def __init__(self, rank=0, clock=time.perf_counter_ns):
        self.rank, self.clock = rank, clock
        self.t0 = clock()
        self._spans = []
        self._lock = threading.Lock()
        self._pending = []

    def record(self, name, cat, start_ns, end_ns, **meta):
        if end_ns < start_ns:
            raise ValueError(f"span {name!r} ends before it starts")
        with self._lock:
            self._spans.append((name, cat, start_ns, end_ns, meta))

    @contextmanager
    def span(self, name, cat="compute", **meta):
        start = self.clock()
        try:
            yield
        finally:
            self.record(name, cat, start, self.clock(), **meta)

    def async_span(self, name, cat, work, **meta):
        """Record a span from now until ``work`` (a ``dist.Work``, or a list of
        works that form one operation) completes; returns what to wait on instead.

        Uses the works' futures where the backend has them (NCCL, gloo
        collectives). gloo's point-to-point works have no future and learn they
        are done only inside ``wait()``, so one helper thread waits on them and
        the caller's ``wait()`` waits for that thread instead."""
        works = list(work) if isinstance(work, (list, tuple)) else [work]
        start = self.clock()

        def done(*_):
            self.record(name, cat, start, self.clock(), **meta)

        try:
            futures = [w.get_future() for w in works]
        except RuntimeError:
            observed = _ObservedWorks(works, done, self._pending)
            proxies = [_WorkProxy(observed) for _ in works]
            return proxies if isinstance(work, (list, tuple)) else proxies[0]
        import torch

        torch.futures.collect_all(futures).then(done)
        return work

    def export(self):
        """Plain data for the launcher to ship: host, t0 and raw spans."""
        for w in list(self._pending):
            w.join()
        with self._lock:
            spans = [dict(name=n, cat=c, start_ns=s, end_ns=e, **m) for n, c, s, e, m in self._spans]
        return {"rank": self.rank, "host": socket.gethostname(), "t0_ns": self.t0, "spans": spans}


_waiters = None  # threads that wait on works without futures, reused across ops


def _waiter_pool():
    global _waiters
    if _waiters is None:
        from concurrent.futures import ThreadPoolExecutor

        # One thread per op in flight (up to 64); a shared FIFO waiter could block
        # on an early receive while a later, finished op waits behind it.
        _waiters = ThreadPoolExecutor(max_workers=64, thread_name_prefix="trace-wait")
    return _waiters


class _ObservedWorks:
    """Works whose completion a pooled helper thread observes (the only thread
    that calls their ``wait``)."""

    def __init__(self, works, on_done, registry):
        self._error, self.done = None, threading.Event()
        registry.append(self)
        self._future = _waiter_pool().submit(self._observe, works, on_done)

    def _observe(self, works, on_done):
        try:
            for w in works:
                w.wait()
            on_done()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's wait()
            self._error = exc
        finally:
            self.done.set()

    def wait(self, timeout=None):
        self.done.wait(timeout)
        if self._error is not None:
            raise self._error
        return True

    def join(self):
        self._future.result()


class _WorkProxy:
    def __init__(self, observed):
        self._observed = observed

    def wait(self, timeout=None):
        return self._observed.wait(timeout)

    def is_completed(self):
        return self._observed.done.is_set()


# ---- the per-process recorder the launcher starts --------------------------------
_current: Tracer | None = None


def start(rank=None):
    """Start recording on this rank, t0 taken right after a barrier so that all
    ranks' t0 agree to within the barrier's skew."""
    global _current
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        rank = dist.get_rank() if rank is None else rank
    _current = Tracer(rank or 0)
    return _current


def finish():
    """Stop recording; return the export, or None if nothing was recorded."""
    global _current
    tracer, _current = _current, None
    if tracer is None:
        return None
    exported = tracer.export()
    return exported if exported["spans"] else None


def get_tracer():
    return _current


@contextmanager
def paused():
    """No recording inside the block (benchmarks: spans cost microseconds, and
    watching gloo's point-to-point works costs a thread hand-off per message)."""
    global _current
    saved, _current = _current, None
    try:
        yield
    finally:
        _current = saved


def span(name, cat="compute", **meta):
    """Module-level span on the current tracer; a no-op when not recording."""
    return _current.span(name, cat, **meta) if _current else nullcontext()


def async_span(name, cat, work, **meta):
    return _current.async_span(name, cat, work, **meta) if _current else work
