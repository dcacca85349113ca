"""Per-rank timelines: record spans on each rank, merge them with aligned clocks.

On a rank (the launcher starts recording for you)::

    with trace.span("forward", "compute", microbatch=0):
        y = model(x)
    work = dist.all_reduce(g, async_op=True)
    trace.async_span("all_reduce", "comm", work, bytes=g.nbytes)  # ends on completion

In the notebook, ``run(...).trace`` is a :class:`Trace` over all ranks, with
times in seconds since a common t0 taken right after a barrier. Metrics
(busy and overlap fractions) live in :mod:`course_lib.trace.metrics`.

On a GPU rank (NCCL) a span times the *device*: CUDA events recorded on the
current stream where it starts and ends, read when the trace is exported
(:class:`~course_lib.runtime.device.EventClock`), so a span around enqueued
kernels lasts as long as they run. An asynchronous operation's span ends when
its work has finished on the device. On CPU ranks spans read the host clock.
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
    """Records spans of one rank with ``time.perf_counter_ns`` (raw nanoseconds).

    With ``device_clock`` (an :class:`~course_lib.runtime.device.EventClock`,
    given on GPU ranks) spans are stamped on the device as well, and exported
    in device time."""

    def __init__(self, rank=0, clock=time.perf_counter_ns, device_clock=None):
        self.rank, self.clock = rank, clock
        self.t0 = clock()
        self.device_clock = device_clock
        self._spans = []
        self._device_spans = []  # (name, cat, start mark, [end marks], meta)
        self._lock = threading.Lock()
        self._watched = []  # (future, the future of its callback), while the callback runs

    def stamp(self):
        """Now, as ``record`` takes it: host nanoseconds, or on a GPU rank a
        device mark on this thread's current stream."""
        return self.device_clock.mark() if self.device_clock else self.clock()

    def record(self, name, cat, start, end, **meta):
        """A span between two :meth:`stamp` (or ``clock()``) values."""
        if isinstance(start, int) and isinstance(end, int):
            if end < start:
                raise ValueError(f"span {name!r} ends before it starts")
            with self._lock:
                self._spans.append((name, cat, start, end, meta))
            return
        start, end = _as_mark(start), _as_mark(end)
        if end[1] < start[1]:
            raise ValueError(f"span {name!r} ends before it starts")
        with self._lock:
            self._device_spans.append((name, cat, start, [end], meta))

    @contextmanager
    def span(self, name, cat="compute", **meta):
        start = self.stamp()
        try:
            yield
        finally:
            self.record(name, cat, start, self.stamp(), **meta)

    def async_span(self, name, cat, work, **meta):
        """Record a span from now until ``work`` (a ``dist.Work``, a list of
        works that form one operation, or anything with ``get_future()``)
        completes; returns what to wait on instead.

        Returns a :class:`~course_lib.handle.Handle`. gloo's point-to-point
        works have no future and learn they are done only inside ``wait()``;
        asking their handle for a future puts a helper thread on them, which
        is why tracing a run costs a thread hand-off per such message (and
        why benchmarks run untraced)."""
        if self.device_clock is not None:
            return self._async_span_on_device(name, cat, work, meta)
        start = self.clock()

        def done(*_):
            self.record(name, cat, start, self.clock(), **meta)

        handle = _as_handle(work)
        self._watch(handle.get_future(), done)
        return handle

    def _watch(self, future, callback):
        """``future.then(callback)``, remembered until the callback has run: a
        future wakes its waiters *before* running its callbacks, so an op the
        caller saw finish may not have recorded its span yet at export."""
        chained = future.then(callback)
        with self._lock:
            self._watched = [(f, c) for f, c in self._watched if not c.done()]
            self._watched.append((future, chained))

    def _settle_callbacks(self):
        """Wait for the callbacks of every completed watched future (ops still in
        flight at export have no span, as before); callbacks may watch more."""
        while True:
            with self._lock:
                running = [c for f, c in self._watched if f.done() and not c.done()]
            if not running:
                return
            for chained in running:
                try:
                    chained.wait()
                except Exception:  # noqa: BLE001 - the op's error belongs to whoever waits on it
                    pass

    def _async_span_on_device(self, name, cat, work, meta):
        """An NCCL future completes as soon as its collective is *enqueued*, so
        its completion time says nothing. What it does offer: a callback added
        with ``then`` runs on a stream that waits for the collective, so an
        event recorded there is stamped when the collective has finished on the
        device. Futures of other kinds (a helper thread's, a gathered list) run
        their callbacks after the work was enqueued on that thread's stream."""
        op = _DeviceOp(self, name, cat, self.device_clock.mark(), meta)
        # Works without a future (a coalesced NCCL p2p may have none) get one from
        # a helper thread that waits on them, which makes its stream wait too.
        handle = _as_handle(work)
        op.watch(handle.get_future())
        op.finish(mark=False)  # the caller's hold
        return handle

    def _add_device_span(self, name, cat, start, ends, meta):
        with self._lock:
            self._device_spans.append((name, cat, start, ends, meta))

    def export(self):
        """Plain data for the launcher to ship: host, t0 and raw spans (host
        nanoseconds; device spans converted onto the host clock here)."""
        self._settle_callbacks()
        with self._lock:
            spans = [dict(name=n, cat=c, start_ns=s, end_ns=e, **m) for n, c, s, e, m in self._spans]
            device_spans = list(self._device_spans)
        if device_spans:
            self.device_clock.settle()
            to_ns = self.device_clock.to_host_ns
            for n, c, start, ends, m in device_spans:
                s = to_ns(start)
                spans.append(dict(name=n, cat=c, start_ns=s,
                                  end_ns=max([s, *(to_ns(e) for e in ends)]), **m))
        return {"rank": self.rank, "host": socket.gethostname(), "t0_ns": self.t0, "spans": spans}


def _as_handle(work):
    """A Handle for a Handle, a ``dist.Work``, or a list of works forming one op."""
    from course_lib.handle import Handle

    return work if isinstance(work, Handle) else Handle.from_works(work)


def _as_mark(stamp):
    """A host-clock integer as a mark with no event (read as the host time)."""
    return (None, stamp) if isinstance(stamp, int) else stamp


class _DeviceOp:
    """One asynchronous operation on a GPU rank: a start mark and one end mark
    per future it depends on, recorded as a span once every future has
    called back. Counts one hold for the caller, released by ``finish()``."""

    def __init__(self, tracer, name, cat, start, meta):
        self.tracer, self.name, self.cat, self.start, self.meta = tracer, name, cat, start, meta
        self._ends, self._holds, self._lock = [], 1, threading.Lock()

    def watch(self, future):
        with self._lock:
            self._holds += 1
        self.tracer._watch(future, self._on_done)

    def _on_done(self, future):
        import torch

        try:
            value = future.value()
        except Exception:  # noqa: BLE001 - a failed op still ends; whoever waits sees the error
            value = None
        inner = value if isinstance(value, list) and value and all(
            isinstance(v, torch._C.Future) for v in value) else None
        if inner is not None:  # collect_all(): the value is the futures themselves
            for f in inner:
                self.watch(f)
        self.finish(mark=inner is None)

    def finish(self, mark=True):
        if mark:
            end = self.tracer.device_clock.mark()
        with self._lock:
            if mark:
                self._ends.append(end)
            self._holds -= 1
            last = self._holds == 0
        if last:
            self.tracer._add_device_span(self.name, self.cat, self.start, self._ends, self.meta)


# ---- the per-process recorder the launcher starts --------------------------------
_current: Tracer | None = None


def start(rank=None):
    """Start recording on this rank, t0 taken right after a barrier so that all
    ranks' t0 agree to within the barrier's skew. On a GPU rank (NCCL) spans
    are also stamped on its device."""
    global _current
    import torch.distributed as dist

    from course_lib.runtime.device import EventClock, current_device

    if dist.is_initialized():
        dist.barrier()
        rank = dist.get_rank() if rank is None else rank
    device = current_device()
    clock = time.perf_counter_ns
    events = EventClock(device, clock) if device.type == "cuda" else None
    _current = Tracer(rank or 0, clock, device_clock=events)
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
    """Module-level :meth:`Tracer.async_span`. Recording or not, the result is a
    :class:`~course_lib.handle.Handle` (a traced run has the same shape)."""
    return _current.async_span(name, cat, work, **meta) if _current else _as_handle(work)


def trace_backward(module, name="backward"):
    """Record a ``compute`` span per backward pass of ``module``: from its first
    gradient hook to the end of gradient computation, before anything queued
    later at the end of backward runs (a DDP's final waits). Call it *before*
    wrapping the module in a DDP, so that these hooks run first::

        trace_backward(net)
        model = DDP(net)

    Returns the hook handles (``handle.remove()`` stops it). Records nothing,
    and costs one hook call per parameter, when no tracer records."""
    import torch

    state = {"start": None}

    def end():
        tracer = get_tracer()
        if tracer is not None and state["start"] is not None:
            tracer.record(name, "compute", state["start"], tracer.stamp())
        state["start"] = None

    def first_hook(_param):
        tracer = get_tracer()
        if tracer is None or state["start"] is not None:
            return
        state["start"] = tracer.stamp()
        torch.autograd.Variable._execution_engine.queue_callback(end)

    return [p.register_post_accumulate_grad_hook(first_hook)
            for p in module.parameters() if p.requires_grad]
