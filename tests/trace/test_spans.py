"""Traces: recording, alignment, asynchronous spans, Chrome JSON, metrics."""
import json
import time

import matplotlib
import pytest
import torch
import torch.distributed as dist

matplotlib.use("Agg")

from conftest import ship_by_value  # noqa: E402
from course_lib import comm, run, trace  # noqa: E402
from course_lib.handle import Handle  # noqa: E402
from course_lib.trace import Span, Trace, Tracer, lanes_of  # noqa: E402
from course_lib.trace.metrics import (busy_fraction, busy_table, intersect,  # noqa: E402
                                      overlap_fraction, total, union)

ship_by_value(__name__)


def make(*spans):
    return Trace([Span(r, n, c, s, e) for r, n, c, s, e in spans])


# ---- pure logic on hand-made traces -----------------------------------------------
def test_union_and_intersection_of_intervals():
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert total([(0, 1), (0.5, 1.5), (5, 5)]) == 1.5
    assert intersect([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]
    assert intersect([(0, 1)], [(1, 2)]) == []


def test_busy_and_overlap_fractions():
    tr = make((0, "fwd", "compute", 0.0, 4.0), (0, "ar1", "comm", 3.0, 5.0),
              (0, "ar2", "comm", 4.5, 6.0),  # overlaps ar1: counted once
              (1, "fwd", "compute", 0.0, 2.0), (1, "ar", "comm", 2.0, 8.0))
    assert busy_fraction(tr, 0, "compute") == pytest.approx(4 / 8)
    assert busy_fraction(tr, 0, "comm") == pytest.approx(3 / 8)
    assert busy_fraction(tr, 0) == pytest.approx(6 / 8)
    assert overlap_fraction(tr, "comm", "compute", rank=0) == pytest.approx(1 / 3)
    assert overlap_fraction(tr, "comm", "compute", rank=1) == 0.0
    assert overlap_fraction(tr) == pytest.approx(1 / 9)  # 1 s hidden of 3 + 6
    table = busy_table(tr)
    assert table[0]["idle"] == pytest.approx(2 / 8) and table[1]["idle"] == pytest.approx(0.0)
    assert overlap_fraction(make((0, "f", "compute", 0, 1)), "comm", "compute") == 0.0


def test_lanes_split_overlapping_async_spans_only():
    tr = make((0, "outer", "compute", 0, 10), (0, "inner", "compute", 2, 3),
              (0, "a", "comm", 0, 5), (0, "b", "comm", 4, 6), (0, "c", "comm", 6, 7))
    lanes = lanes_of(tr.spans)
    names = [(name, [s.name for s in spans]) for name, _, spans in lanes]
    assert names == [("compute", ["outer", "inner"]), ("comm", ["a", "c"]), ("comm #2", ["b"])]
    assert [tid for _, tid, _ in lanes] == [1, 2, 3]


def test_exports_align_on_one_host_and_across_hosts():
    def export(rank, host, t0, start, end):
        return {"rank": rank, "host": host, "t0_ns": t0,
                "spans": [{"name": "x", "cat": "compute", "start_ns": start, "end_ns": end,
                           "microbatch": 3, "note": "kept"}]}

    one_host = Trace.from_exports([export(0, "a", 1_000, 1_500, 2_000),
                                   export(1, "a", 1_200, 1_700, 2_200)])
    s0, s1 = one_host.spans
    assert (s0.start, s1.start) == (pytest.approx(500e-9), pytest.approx(700e-9))
    assert s0.microbatch == 3 and s0.args == {"note": "kept"}
    two_hosts = Trace.from_exports([export(0, "a", 1_000, 1_500, 2_000),
                                    export(1, "b", 9_000, 9_500, 10_000)])
    assert [s.start for s in two_hosts.spans] == [pytest.approx(500e-9)] * 2


def test_chrome_trace_shape(tmp_path):
    tr = Trace([Span(0, "fwd", "compute", 0.0, 0.002, microbatch=1),
                Span(1, "send", "comm", 0.001, 0.003, bytes=64, peer=0)])
    doc = tr.to_chrome(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == doc
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["name"]) for e in complete} == {(0, "fwd"), (1, "send")}
    send = next(e for e in complete if e["name"] == "send")
    assert send["ts"] == pytest.approx(1000) and send["dur"] == pytest.approx(2000)
    assert send["args"] == {"bytes": 64, "peer": 0} and send["tid"] >= 1
    meta = {(e["name"], e["pid"]): e["args"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert meta[("process_name", 1)] == {"name": "rank 1"}
    assert meta[("process_sort_index", 1)] == {"sort_index": 1}
    assert ("thread_name", 0) in meta


def test_tracer_records_context_spans_and_rejects_reversed_ones():
    ticks = iter(range(0, 1000, 10))
    tracer = Tracer(rank=2, clock=lambda: next(ticks))
    with tracer.span("step", "compute", microbatch=0):
        pass
    exported = tracer.export()
    assert exported["rank"] == 2 and exported["spans"][0]["end_ns"] > exported["spans"][0]["start_ns"]
    with pytest.raises(ValueError):
        tracer.record("bad", "comm", 10, 5)


def test_gantt_draws_one_bar_per_span():
    tr = make((0, "a", "compute", 0, 1), (0, "b", "comm", 0.5, 2), (1, "c", "comm", 0, 1))
    ax = tr.plot()
    bars = [c for c in ax.collections]
    assert len(bars) == 3
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]


# ---- on real ranks ------------------------------------------------------------------
def late_receiver_p2p():
    """Rank 1 posts its receive 0.3 s late; rank 0 waits on its isend only at 1 s."""
    rank = dist.get_rank()
    buf = torch.ones(1000)
    if rank == 0:
        work = comm.isend(buf, 1)
        time.sleep(1.0)
        with trace.span("wait called", "other"):
            work.wait()
    else:
        time.sleep(0.3)
        comm.recv(buf, 0)


def late_joiner_collective():
    if dist.get_rank() == 1:
        time.sleep(0.3)
    work = trace.async_span("all_reduce", "comm", dist.all_reduce(torch.ones(10), async_op=True))
    if dist.get_rank() == 0:
        time.sleep(1.0)
        with trace.span("wait called", "other"):
            work.wait()
    else:
        work.wait()


@pytest.mark.parametrize("job,name", [(late_receiver_p2p, "isend→1"),
                                      (late_joiner_collective, "all_reduce")])
def test_async_span_ends_at_completion_not_at_wait(job, name):
    tr = run(job, nproc=2).trace
    (op,) = tr.select(rank=0, name=name)
    (wait,) = tr.select(rank=0, name="wait called")
    assert op.end < wait.start  # completed long before anyone waited on it


def causal_pair():
    x = torch.zeros(1)
    if dist.get_rank() == 0:
        with trace.span("before send", "compute"):
            time.sleep(0.05)
        comm.send(x, 1)
    else:
        comm.recv(x, 0)
        with trace.span("after recv", "compute"):
            pass


def test_aligned_clocks_keep_cause_before_effect():
    tr = run(causal_pair, nproc=2).trace
    (before,) = tr.select(name="before send")
    (after,) = tr.select(name="after recv")
    assert before.rank == 0 and after.rank == 1
    assert before.end <= after.start
    assert tr.start >= 0  # t0 is taken after the barrier that precedes all spans


# ---- device timing: nothing changes on CPU ranks ------------------------------------
def cpu_rank_touching_no_cuda():
    """Every device helper and every kind of span, with torch.cuda's entry points
    replaced by recorders: on a gloo rank none may be reached."""
    import concurrent.futures

    from course_lib import sync
    from course_lib.runtime.device import (record_event, run_after, set_thread_device,
                                           wait_event)

    reached = []
    for name in ("synchronize", "Event", "current_stream", "set_device", "init", "_lazy_init"):
        setattr(torch.cuda, name, lambda *a, _n=name, **k: reached.append(_n))
    sync()
    set_thread_device()
    event = record_event()
    wait_event(event)
    assert run_after(event, lambda v: v + 1, 1) == 2
    with concurrent.futures.ThreadPoolExecutor(1, initializer=set_thread_device) as pool:
        thread_device = pool.submit(lambda: str(torch.get_default_device())).result()
    rank = dist.get_rank()
    x = torch.ones(100)
    with trace.span("compute", "compute"):
        x.mul_(2)
    trace.async_span("all_reduce", "comm", dist.all_reduce(x, async_op=True)).wait()
    peer = 1 - rank
    works = [comm.isend(x, peer), comm.irecv(torch.empty(100), peer)]  # no futures on gloo
    for w in works:
        w.wait()
    return (reached, torch.cuda.is_initialized(), event, thread_device,
            type(trace.get_tracer().stamp()).__name__, trace.get_tracer().device_clock)


def test_sync_and_spans_never_touch_cuda_on_gloo_ranks():
    res = run(cpu_rank_touching_no_cuda, nproc=2, backend="gloo")
    for reached, initialised, event, thread_device, stamp_type, device_clock in res:
        assert reached == [] and initialised is False
        assert event is None and thread_device == "cpu"
        assert stamp_type == "int" and device_clock is None  # host clock only
    names = {s.name for s in res.trace.select(rank=0)}
    assert {"compute", "all_reduce", "isend→1", "irecv←1"} <= names


# ---- device timing logic, with a stand-in for CUDA events ---------------------------
class FakeEventClock:
    """Marks as an EventClock makes them; the 'device' reaches each mark
    ``lag`` ns after the host recorded it."""

    def __init__(self, clock, lag=1_000):
        self.clock, self.lag, self.settled, self.marks = clock, lag, 0, 0

    def mark(self):
        self.marks += 1
        host = self.clock()
        return {"device_ns": host + self.lag}, host

    def settle(self):
        self.settled += 1

    def to_host_ns(self, mark):
        event, host = mark
        return host if event is None else event["device_ns"]


def device_tracer(lag=1_000):
    ticks = iter(range(0, 10**9, 10))
    clock = lambda: next(ticks)  # noqa: E731
    return Tracer(rank=0, clock=clock, device_clock=FakeEventClock(clock, lag))


class FutureWork:
    """A work whose future the test completes by hand (as a collective's)."""

    def __init__(self, future=None):
        self.future = future if future is not None else torch.futures.Future()

    def get_future(self):
        return self.future

    def wait(self):
        return self.future.wait()


def spans_by_name(tracer):
    return {s["name"]: s for s in tracer.export()["spans"]}


def test_device_spans_are_exported_in_device_time():
    tracer = device_tracer(lag=1_000)
    with tracer.span("kernel", "compute", bytes=8):
        pass
    start, end = tracer.stamp(), tracer.stamp()
    tracer.record("between stamps", "compute", start, end)
    tracer.record("host only", "other", 5, 7)  # plain clock values stay host-timed
    spans = spans_by_name(tracer)
    assert (spans["kernel"]["start_ns"], spans["kernel"]["end_ns"]) == (1_010, 1_020)
    assert spans["kernel"]["bytes"] == 8
    assert spans["between stamps"]["end_ns"] - spans["between stamps"]["start_ns"] == 10
    assert (spans["host only"]["start_ns"], spans["host only"]["end_ns"]) == (5, 7)
    assert tracer.device_clock.settled == 1  # the device is waited for once, at export
    with pytest.raises(ValueError):
        tracer.record("reversed", "comm", end, start)


def test_device_async_span_ends_at_the_last_completion():
    tracer = device_tracer()
    first, second = FutureWork(), FutureWork()
    returned = tracer.async_span("pair", "comm", [first, second])
    assert isinstance(returned, Handle)  # one operation, one handle
    first.future.set_result(None)
    assert "pair" not in spans_by_name(tracer)  # half done: no span yet
    for _ in range(5):
        tracer.clock()  # time passes before the second part completes
    second.future.set_result(None)
    returned.wait()  # both works, waited one by one (by a waiter thread: no collect_all)
    assert returned.is_completed()
    pair = spans_by_name(tracer)["pair"]
    # ticks: t0 0, start mark 10, idle 20-60; the end is marked after the second completes
    assert pair["start_ns"] == 1_010 and pair["end_ns"] >= 1_070


def test_device_async_span_looks_inside_gathered_futures():
    """A handle may hand out ``collect_all`` of its works' futures: the end is
    taken from each inner future, where a CUDA future's stream is known."""
    tracer = device_tracer()
    inner = [torch.futures.Future(), torch.futures.Future()]
    gathered = FutureWork(torch.futures.collect_all(inner))
    tracer.async_span("gathered", "comm", gathered)
    inner[0].set_result(None)
    assert "gathered" not in spans_by_name(tracer)
    inner[1].set_result(None)
    span = spans_by_name(tracer)["gathered"]
    assert span["end_ns"] > span["start_ns"]
    assert tracer.device_clock.marks == 1 + len(inner)  # the start, then one end per inner future


def test_device_async_span_of_a_futureless_work_ends_after_its_wait():
    class NoFuture:
        def __init__(self):
            self.released = __import__("threading").Event()

        def get_future(self):
            raise RuntimeError("no future for point-to-point")

        def wait(self):
            self.released.wait(5)

    tracer = device_tracer()
    work = NoFuture()
    proxy = tracer.async_span("recv", "comm", work)
    assert proxy is not work and not proxy.is_completed()
    work.released.set()
    assert proxy.wait(5) and proxy.is_completed()
    recv = spans_by_name(tracer)["recv"]
    assert recv["end_ns"] > recv["start_ns"]
