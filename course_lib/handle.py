"""One handle for every asynchronous operation: a p2p message, a collective, a DDP bucket.

torch gives back different things for "started, not finished": a ``dist.Work``
(whose ``get_future()`` exists for collectives and NCCL but raises for gloo's
point-to-point), a ``torch.futures.Future``, or nothing at all when work runs on
a helper thread. :class:`Handle` puts one face on all of them::

    h = comm.isend(x, dst=1)          # or all_reduce(x, async_op=True), a DDP bucket
    ...                               # compute while the bytes travel
    h.wait()                          # returns once the operation has completed
    h.is_completed(); h.get_future()  # a torch.futures.Future, for callbacks and traces

gloo's point-to-point works learn that they are done only inside ``wait()``, so
for them a future is made on demand: the first ``get_future()`` hands the works
to a pooled waiter thread that completes it. Untraced code never asks, and pays
no thread hand-off per message.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_pool_lock = threading.Lock()
_waiters = None  # threads that wait on futureless works, shared by all handles
_lanes: dict = {}  # one ordered thread per key (a process group): see Handle.on_thread


def _waiter_pool():
    global _waiters
    with _pool_lock:
        if _waiters is None:
            # One thread per operation in flight: a single FIFO waiter could block on
            # an early receive while a later, finished operation waits behind it.
            _waiters = ThreadPoolExecutor(max_workers=64, thread_name_prefix="handle-wait",
                                          initializer=_thread_setup)
        return _waiters


def _thread_setup():
    """Helper threads compute on the rank's device (set per thread in torch)."""
    try:
        from course_lib.runtime.device import set_thread_device
    except ImportError:  # the runtime layer is optional for pure uses of the handle
        return
    set_thread_device()


def _record_event():
    try:
        from course_lib.runtime.device import record_event
    except ImportError:
        return None
    return record_event()


def _wait_event(event):
    if event is not None:
        from course_lib.runtime.device import wait_event

        wait_event(event)


def _lane(key):
    with _pool_lock:
        lane = _lanes.get(key)
        if lane is None:
            lane = _lanes[key] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="op-lane",
                                                    initializer=_thread_setup)
        return lane


class Handle:
    """An operation in flight. Build one with :meth:`from_works`, :meth:`from_future`,
    :meth:`on_thread` or :meth:`completed`; use ``wait()``, ``is_completed()``,
    ``get_future()`` as on a ``dist.Work``."""

    def __init__(self, future=None, works=()):
        self._future = future
        self._works = list(works)  # futureless works not yet waited for
        self._lock = threading.Lock()
        self._done = future is None and not self._works

    # ---- construction ------------------------------------------------------------
    @classmethod
    def from_works(cls, works):
        """One operation made of one or more ``dist.Work`` (or handles)."""
        works = [w for w in (works if isinstance(works, (list, tuple)) else [works])
                 if w is not None]
        futures = []
        for w in works:
            try:
                futures.append(w.get_future())
            except RuntimeError:  # gloo point-to-point: no future until someone waits
                return cls(works=works)
        if not futures:
            return cls.completed()
        return cls(future=futures[0] if len(futures) == 1 else torch.futures.collect_all(futures))

    @classmethod
    def from_future(cls, future):
        return cls(future=future)

    @classmethod
    def on_thread(cls, key, fn, *args, **kwargs):
        """Run ``fn`` on the helper thread of ``key`` (one thread per key, so the
        operations of one process group start in the order they were issued on
        every rank, as collectives must)."""
        future = torch.futures.Future()
        # On a GPU the caller's stream may still be filling the tensors: the helper
        # thread's stream waits for an event recorded here before it starts.
        ready = _record_event()

        def body():
            try:
                _wait_event(ready)
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits
                future.set_exception(exc)

        _lane(key).submit(body)
        return cls(future=future)

    @classmethod
    def completed(cls, value=None):
        future = torch.futures.Future()
        future.set_result(value)
        return cls(future=future)

    # ---- the Work interface ---------------------------------------------------------
    def wait(self, timeout=None):
        """Block until the operation has completed; re-raises its error."""
        with self._lock:
            works, self._works = self._works, []
            future = self._future
        if works and future is None:  # nobody watches them: wait right here
            for w in works:
                w.wait()
            with self._lock:
                self._done = True
                late = self._future  # asked for while we were waiting
            if late is not None and not late.done():
                late.set_result(None)
            return True
        if future is not None:
            future.wait()
        return True

    def is_completed(self):
        with self._lock:
            if self._future is not None:
                return self._future.done()
            return self._done

    def get_future(self):
        """A ``torch.futures.Future`` completed when the operation completes."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                works, self._works = self._works, []
                if works:
                    _waiter_pool().submit(_complete_when_done, works, self._future)
                elif self._done:
                    self._future.set_result(None)
                # else: a wait() in progress completes it
            return self._future


def _complete_when_done(works, future):
    try:
        for w in works:
            w.wait()
        future.set_result(None)
    except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits
        future.set_exception(exc)


def wait_all(handles):
    for h in handles:
        h.wait()
