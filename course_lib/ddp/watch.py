"""What a data-parallel wrapper communicates, seen from outside it.

:func:`watching_all_reduces` stands in for ``torch.distributed.all_reduce`` for the
length of a block, so a DDP class that knows nothing of the course's tracer can
still be measured and drawn (Lab 02's blank-page DDP, in the check and on its
timeline). Every call made through that attribute (``dist.all_reduce(...)`` in a
notebook's class, or course_lib's collectives, which call it) is logged in the
order it happened, into a list the caller may fill with events of its own (a
gradient hook firing, the end of backward), so the order of events on one rank
can be read back without comparing clocks. When a tracer records, each call is
also a ``comm`` span that ends when the operation completes::

    events = []
    with watching_all_reduces(events) as works:
        loss_fn(model(x), y).backward()
    [e for e in events if e[0] == "all_reduce"]   # ("all_reduce", numel, async_op)
    [w for w in works if not w.waited]            # launched, and never waited for

A name bound before the block (``from torch.distributed import all_reduce``) is not
seen, nor a collective made by another API (torch's own DDP works in C++).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist

from course_lib import trace


class WatchedWork:
    """The work of one asynchronous all-reduce, as the caller receives it: the same
    operation, plus ``waited``, whether anyone asked for its result (``wait()``, its
    future, or ``is_completed()`` answering yes) before reading the tensor."""

    def __init__(self, work):
        self._work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def get_future(self):
        self.waited = True  # whoever takes the future chains or waits on it
        return self._work.get_future()

    def is_completed(self):
        done = self._work.is_completed()
        self.waited = self.waited or done
        return done

    def __getattr__(self, name):  # the rest of dist.Work, unchanged
        return getattr(self._work, name)


@contextmanager
def watching_all_reduces(events):
    """Inside the block, every ``dist.all_reduce`` call appends ``("all_reduce", numel,
    async_op)`` to ``events``; yields the list of :class:`WatchedWork` handed back to
    the asynchronous calls."""
    original, works = dist.all_reduce, []

    def watched(tensor, *args, **kwargs):
        async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
        events.append(("all_reduce", tensor.numel(), async_op))
        work = original(tensor, *args, **kwargs)
        if work is None:
            return None
        if trace.get_tracer() is not None:
            # the span watches the operation itself: drawing it waits for nothing
            trace.async_span(f"all_reduce {tensor.numel():,}", "comm", work,
                             bytes=tensor.numel() * tensor.element_size())
        works.append(WatchedWork(work))
        return works[-1]

    dist.all_reduce = watched
    try:
        yield works
    finally:
        dist.all_reduce = original
