"""The rank's device: waiting for it, pointing helper threads at it, ordering work on it.

A CUDA kernel or an NCCL collective returns to Python once it is *enqueued*;
the GPU runs it later. A host clock read around such a call measures the
enqueue (microseconds), not the work. So every timing brackets device work
with :func:`sync`::

    sync(); t = time.perf_counter()
    all_reduce(x)
    sync(); seconds = time.perf_counter() - t

Under gloo (CPU ranks) :func:`sync` does nothing and never touches CUDA.

Three more things the layers above need on a GPU rank:

- :func:`set_thread_device`: torch keeps the current CUDA device, the default
  device *and* the current stream per thread, and the launcher sets them on the
  main thread only. Every helper thread (the rank's operation thread, a trace
  waiter) calls it first, and gets a stream of its own; :func:`record_streams`
  for the tensors it receives from another thread.
- :func:`record_event` / :func:`wait_event`: a tensor filled on one stream and
  reduced from another thread's stream must be ordered on the device, not by
  the host: record after the fill, wait before the collective.
- :class:`EventClock`: CUDA events mapped onto the host clock, so that trace
  spans show when work ran on the device.
"""
from __future__ import annotations

import time

import torch

from course_lib.runtime.backend import current_device


def _device_or_rank(device):
    return current_device() if device is None else torch.device(device)


def sync(device=None):
    """Wait until every kernel and collective enqueued on the device has finished.

    ``device=None`` means this rank's device (``cuda:LOCAL_RANK`` under NCCL,
    CPU otherwise); a CUDA device may be named explicitly. On CPU it returns
    at once without initialising CUDA."""
    device = _device_or_rank(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_thread_device(own_stream=False):
    """Make the calling thread compute on this rank's device (call it first
    thing in a helper thread, e.g. as a ``ThreadPoolExecutor`` initializer).

    Under NCCL: the thread's current CUDA device and its default device become
    the rank's GPU, as on the main thread, and with ``own_stream`` its current
    stream a new one: what it waits for or launches does not queue behind, or
    hold up, the main thread's kernels. Under gloo it does nothing."""
    device = current_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_default_device(device)
        if own_stream:
            torch.cuda.set_stream(torch.cuda.Stream(device))


def record_streams(values):
    """Tell the caching allocator that the CUDA tensors in ``values`` (nested in
    tuples, lists and dicts) are used on this thread's current stream too, so
    that their memory is not handed out again while work queued there still
    reads or writes it. Nothing to do on CPU."""
    if current_device().type != "cuda":
        return
    stream = torch.cuda.current_stream()
    todo = [values]
    while todo:
        value = todo.pop()
        if isinstance(value, torch.Tensor):
            if value.is_cuda:
                value.record_stream(stream)
        elif isinstance(value, (tuple, list)):
            todo.extend(value)
        elif isinstance(value, dict):
            todo.extend(value.values())


def record_event(device=None):
    """A CUDA event recorded on this thread's current stream of ``device``
    (default: the rank's), marking everything enqueued there so far; ``None``
    on CPU, where host order is already device order."""
    device = _device_or_rank(device)
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait_event(event, device=None):
    """Make this thread's current stream wait (on the device, not the host) for
    ``event`` from :func:`record_event`. ``None`` is a no-op."""
    if event is None:
        return
    device = _device_or_rank(device)
    if device.type != "cuda":  # an event with no CUDA device to wait on: the host waits
        event.synchronize()
        return
    event.wait(torch.cuda.current_stream(device))


def run_after(event, fn, *args, **kwargs):
    """``wait_event(event)`` then ``fn(*args, **kwargs)``: what a helper thread
    runs when another thread hands it a tensor together with its ready event."""
    wait_event(event)
    return fn(*args, **kwargs)


class EventClock:
    """Timestamps taken on a CUDA device, read on the host clock.

    :meth:`mark` records a timing event on the calling thread's current
    stream; the GPU stamps it when it reaches it, after everything enqueued
    before. Event times are only known relative to each other
    (``elapsed_time``, in ms), so one reference event is recorded on an idle
    device at construction and its host time taken as the midpoint of the
    record and the wait for it; a mark's host time is then
    ``ref_ns + elapsed_ms * 1e6``. Events can be read only once the device has
    passed them: call :meth:`settle` before :meth:`to_host_ns`.

    A mark also keeps the host time at which it was recorded: an event never
    completes before it is recorded, so converted times are clamped to it
    (this absorbs the reference's few microseconds of uncertainty)."""

    def __init__(self, device, clock=time.perf_counter_ns):
        self.device, self.clock = torch.device(device), clock
        torch.cuda.synchronize(self.device)
        self._ref = torch.cuda.Event(enable_timing=True)
        before = clock()
        self._ref.record(torch.cuda.current_stream(self.device))
        self._ref.synchronize()
        self._ref_ns = (before + clock()) // 2

    def mark(self):
        """``(event, host_ns)`` for the point reached by this thread's current stream."""
        host_ns = self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event, host_ns

    def settle(self):
        """Wait until the device has passed every mark."""
        torch.cuda.synchronize(self.device)

    def to_host_ns(self, mark):
        event, host_ns = mark
        if event is None:
            return host_ns
        try:
            device_ns = self._ref_ns + round(self._ref.elapsed_time(event) * 1e6)
        except RuntimeError:  # never reached by the device (its stream failed): host time
            return host_ns
        return max(host_ns, device_ns)
