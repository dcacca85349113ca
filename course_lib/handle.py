"""One handle for every asynchronous operation: a p2p message, a collective, a DDP bucket.

torch gives back different things for "started, not finished": a ``dist.Work``
(a collective's has a future; gloo's point-to-point works have none; a
coalesced NCCL point-to-point work from ``batch_isend_irecv`` has none that can
be trusted), a ``torch.futures.Future``, or nothing at all when work runs on a
helper thread. :class:`Handle` puts one face on all of them::

    h = comm.isend(x, dst=1)          # or all_reduce(x, async_op=True), a DDP bucket
    ...                               # compute while the bytes travel
    h.wait()                          # returns once the operation has completed
    h.is_completed(); h.get_future()  # a torch.futures.Future, for callbacks and traces

Waiting means what it means to torch on each backend:

- works are waited themselves, one by one, on the waiting thread: gloo blocks
  until the bytes are there; NCCL makes the waiting thread's *current stream*
  wait for the operation (later kernels on it see the received data), without
  blocking the host. A point-to-point work is never asked for a future;
- an operation run on the helper thread (:meth:`Handle.on_thread`) ends with an
  event recorded on that thread's own CUDA stream, and ``wait()`` makes the
  caller's stream wait for it (on CPU, host order is device order: no events).

``get_future()``, for traces and callbacks: a collective's own future where it
has one, otherwise a future completed by a waiter thread that waits the works
(on a GPU, on a stream of its own, which is then ordered after the operation:
an event recorded in a callback marks its end on the device). Untraced code
never asks, and pays no thread hand-off per message.

All asynchronous operations of a rank run on one helper thread, in the order
they were issued (:meth:`Handle.on_thread`): NCCL requires every rank to issue
the operations of a communicator in the same order, and ranks that launch the
kernels of different communicators in different orders can deadlock; one
issuing thread per rank keeps one order. :func:`run_in_order` lets a blocking
collective take its turn behind the asynchronous ones already issued.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_pool_lock = threading.Lock()
_waiters = None  # threads that wait on futureless works, shared by all handles
_lane = None  # the one ordered helper thread of this process: see Handle.on_thread
_lane_state = {"busy": 0, "thread": None}  # tasks submitted and not finished; its thread


def _waiter_pool():
    global _waiters
    with _pool_lock:
        if _waiters is None:
            # One thread per operation in flight: a single FIFO waiter could block on
            # an early receive while a later, finished operation waits behind it.
            _waiters = ThreadPoolExecutor(max_workers=64, thread_name_prefix="handle-wait",
                                          initializer=_thread_setup)
        return _waiters


def _the_lane():
    global _lane
    with _pool_lock:
        if _lane is None:
            _lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="op-lane",
                                       initializer=_lane_setup)
        return _lane


def _lane_setup():
    _lane_state["thread"] = threading.get_ident()
    _thread_setup()


def _thread_setup():
    """Helper threads compute on the rank's device, on a CUDA stream of their own (not
    the stream backward runs on: a wait queued there would hold up the compute)."""
    try:
        from course_lib.runtime.device import set_thread_device
    except ImportError:  # the runtime layer is optional for pure uses of the handle
        return
    set_thread_device(own_stream=True)


def _device():
    try:
        from course_lib.runtime import device
    except ImportError:
        return None
    return device


def _record_event():
    device = _device()
    return device.record_event() if device is not None else None


def _wait_event(event):
    if event is not None:
        _device().wait_event(event)


def _record_streams(values):
    device = _device()
    if device is not None:
        device.record_streams(values)


class Handle:
    """An operation in flight. Build one with :meth:`from_works`, :meth:`from_future`,
    :meth:`on_thread` or :meth:`completed`; use ``wait()``, ``is_completed()``,
    ``get_future()`` as on a ``dist.Work``."""

    def __init__(self, future=None, works=(), p2p=False):
        self._future = future  # on_thread / from_future / completed
        self._works = list(works)  # dist.Work objects (or Handles)
        self._pending = list(works)  # not yet waited by anyone: a gloo work is waited once
        self._p2p = p2p
        self._callbacks_future = None  # what get_future() handed out for works
        self._end_event = None  # on_thread: recorded on the helper's stream at the end
        self._lock = threading.Lock()

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_works(cls, works, p2p=False):
        """One operation made of one or more ``dist.Work`` (``p2p``: point-to-point
        messages, whose works are never asked for a future)."""
        works = [w for w in (works if isinstance(works, (list, tuple)) else [works])
                 if w is not None]
        if not works:
            return cls.completed()
        if all(isinstance(w, Handle) for w in works) and len(works) == 1:
            return works[0]
        return cls(works=works, p2p=p2p)

    @classmethod
    def from_future(cls, future):
        return cls(future=future)

    @classmethod
    def on_thread(cls, key, fn, *args, **kwargs):
        """Run ``fn`` on the rank's helper thread (one for the whole process, whatever
        ``key``, the group, says: operations start in the order they were issued, on
        every rank, across all groups) and return a Handle at once."""
        future = torch.futures.Future()
        handle = cls(future=future)
        # On a GPU the caller's stream may still be filling the tensors: the helper
        # thread's stream waits for an event recorded here before it starts.
        ready = _record_event()

        def body():
            try:
                _wait_event(ready)
                _record_streams((args, kwargs))  # used on the helper's stream too
                result = fn(*args, **kwargs)
                handle._end_event = _record_event()
                future.set_result(result)
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits
                future.set_exception(exc)
            finally:
                with _pool_lock:
                    _lane_state["busy"] -= 1

        with _pool_lock:
            _lane_state["busy"] += 1
        _the_lane().submit(body)
        return handle

    @classmethod
    def completed(cls, value=None):
        future = torch.futures.Future()
        future.set_result(value)
        return cls(future=future)

    # ---- the Work interface ------------------------------------------------------------
    def wait(self, timeout=None):
        """Block until the operation has completed (on a GPU: order the caller's stream
        after it); re-raises its error."""
        if self._future is not None:
            self._future.wait()
            _wait_event(self._end_event)
            return True
        with self._lock:
            mine, self._pending = self._pending, []
            handed = self._callbacks_future
        for work in mine:
            work.wait()
        if handed is not None and not mine:  # a waiter thread has them: its future says
            handed.wait()
            if _on_gpu():  # NCCL: a wait orders a stream, and it is this thread's that must
                for work in self._works:
                    work.wait()
        return True

    def is_completed(self):
        if self._future is not None:
            return self._future.done()
        if self._callbacks_future is not None and not self._pending:
            return self._callbacks_future.done()
        return all(w.is_completed() for w in self._works)

    def get_future(self):
        """A ``torch.futures.Future`` completed when the operation completes."""
        if self._future is not None:
            return self._future
        with self._lock:
            if self._callbacks_future is None:
                self._callbacks_future = self._future_of_works()
            return self._callbacks_future

    def _future_of_works(self):
        """(under the lock) a collective's own future, or one a waiter thread completes."""
        if len(self._pending) == 1 and not self._p2p:
            work = self._pending[0]
            try:
                future = work.get_future()  # a collective's own future: no thread needed
            except RuntimeError:
                future = None
            if future is not None:
                return future
        future = torch.futures.Future()
        if not self._pending:  # waited already
            future.set_result(None)
            return future
        works, self._pending = self._pending, []
        _waiter_pool().submit(_complete_when_done, works, future)
        return future


def _on_gpu():
    device = _device()
    return device is not None and device.current_device().type == "cuda"


def _complete_when_done(works, future):
    try:
        for w in works:
            w.wait()
        future.set_result(None)
    except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits
        future.set_exception(exc)


def run_in_order(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, issued in this rank's order: here and now when nothing
    issued asynchronously is still running, else on the helper thread behind it, waited
    for. A blocking collective called while a DDP bucket's ring is in flight thus starts
    after it on every rank, whichever of them happens to be further along."""
    with _pool_lock:
        inline = _lane_state["busy"] == 0 or _lane_state["thread"] == threading.get_ident()
    if inline:
        return fn(*args, **kwargs)
    handle = Handle.on_thread(None, fn, *args, **kwargs)
    handle.wait()
    return handle._future.value()


def wait_all(handles):
    for h in handles:
        h.wait()
