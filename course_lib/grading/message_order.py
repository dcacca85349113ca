"""The order of one rank's messages, as its code posted and saw them (Lab 01's
pipelined-broadcast check).

``message_order()`` wraps the entry points of :mod:`course_lib.comm` for the
duration of a block and records "send" when a send is posted and "recv" when
the caller has seen a receive complete; the real calls still do the work. A
pipelined rank in the middle of a chain alternates (recv, send, recv, send...);
a store-and-forward rank receives everything first::

    with message_order() as events:
        pipelined_broadcast(x, src=0, segments=4)
    received_before_each_send(events)   # [1, 2, 3, 4] pipelined, [4, 4, 4, 4] not
"""
from __future__ import annotations

from contextlib import contextmanager

from course_lib import comm


class _Watched:
    """A handle of receives: records them as received once the caller has seen
    them complete (``wait()`` returned, or ``is_completed()`` said so)."""

    def __init__(self, handle, count, events):
        self._handle, self._count, self._events, self._seen = handle, count, events, False

    def _mark(self):
        if not self._seen:
            self._seen = True
            self._events.extend(["recv"] * self._count)

    def wait(self, *args, **kwargs):
        out = self._handle.wait(*args, **kwargs)
        self._mark()
        return out

    def is_completed(self):
        done = self._handle.is_completed()
        if done:
            self._mark()
        return done

    def __getattr__(self, name):  # get_future and the rest: not watched
        return getattr(self._handle, name)


@contextmanager
def message_order():
    """On this rank, record the order in which the code inside posted its sends and
    saw its receives complete: a list of "send" and "recv", one per message.
    Covers every entry point of :mod:`course_lib.comm`; put back on exit."""
    events = []
    saved = {name: getattr(comm, name) for name in ("_count_send", "recv", "irecv",
                                                    "exchange_async")}

    def count_send(tensor, peer):
        events.append("send")
        saved["_count_send"](tensor, peer)

    def recv(*args, **kwargs):
        out = saved["recv"](*args, **kwargs)
        events.append("recv")
        return out

    def irecv(*args, **kwargs):
        return _Watched(saved["irecv"](*args, **kwargs), 1, events)

    def exchange_async(sends=(), recvs=(), *args, **kwargs):
        sends, recvs = list(sends), list(recvs)
        handle = saved["exchange_async"](sends, recvs, *args, **kwargs)
        return _Watched(handle, len(recvs), events) if recvs else handle

    patched = {"_count_send": count_send, "recv": recv, "irecv": irecv,
               "exchange_async": exchange_async}
    try:
        for name, fn in patched.items():
            setattr(comm, name, fn)
        yield events
    finally:
        for name, fn in saved.items():
            setattr(comm, name, fn)


def received_before_each_send(events):
    """[number of receives seen complete before send k was posted, for each send k]."""
    counts, received = [], 0
    for event in events:
        if event == "recv":
            received += 1
        else:
            counts.append(received)
    return counts
