"""What a rank put on the wire, counted beneath the student's code (door 4 of issue 30).

``course_lib.comm`` counts the messages of the course's own calls, in the rank's
Python, beside the student's code: a student who has read it can write to its
counters, or send around it. A check that grades traffic therefore reads it from
here instead. :func:`counting` opens ``comm.counting()`` and, for the same block,
wraps the methods of torch's process-group classes that every point-to-point
message goes through, whichever call made it (``comm``, ``dist.send``,
``batch_isend_irecv``, the group object itself, its backend): those wrappers keep
their own tally, in a closure of the judge's job, and the traffic a check reads is
theirs.

The seal is broken, and the check fails saying so (a person reads the notebook),
when at the end of the block a wrapper is no longer in its place, or when ``comm``
counted more than went out (its counters were written). Traffic that went out
around ``comm`` is simply counted, as it should be::

    with wire.counting() as traffic:
        fn(tensor, op)
    report = traffic.as_dict()      # comm.CommStats.as_dict(), the wire's p2p counts

Collective calls (``collectives``, ``collective_bytes``) are still ``comm``'s count.
Other instruments of a job (a FLOP counter, a dispatch mode that records the order of
operations, wrappers on ``comm``'s calls) are sealed by :func:`watch`: the block's
report says the seal broke when one of them is no longer in force afterwards.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

BROKEN = "seal_broken"  # the key of an answer whose instruments were written to
NOT_P2P = "collectives_called"  # the key of an answer that used collectives where it may not
P2P_FIELDS = ("sent_messages", "sent_bytes", "recv_messages", "recv_bytes")
# the process group's collectives (a barrier only synchronises: it carries no data)
COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base",
               "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single",
               "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base",
               "reduce_scatter_tensor_coalesced", "reduce_scatter_single",
               "reduce_scatter_single_coalesced", "broadcast", "alltoall", "alltoall_base",
               "all_to_all_single", "reduce", "gather", "scatter")


def _classes():
    """torch's process-group classes, the backends' included: a message sent through a
    backend object directly goes past ``ProcessGroup``'s methods."""
    from torch._C import _distributed_c10d as c10d

    names = ("ProcessGroup", "Backend", "ProcessGroupGloo", "ProcessGroupNCCL")
    return [getattr(c10d, name) for name in names if hasattr(c10d, name)]


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


class Traffic:
    """The block's traffic: the wire's point-to-point counts over ``comm``'s report."""

    def __init__(self, stats, p2p_only=False):
        self.stats = stats  # comm's CommStats for the same block
        self.sent, self.received = Counter(), Counter()  # peer -> bytes
        self.sent_messages = self.recv_messages = 0
        self.collective_calls = Counter()  # the process group's method -> calls
        self.last_received = None  # the tensors of the last receive: what really arrived
        self.p2p_only = p2p_only
        self.broken = []

    def add(self, sending, tensors, peer):
        if sending:
            self.sent_messages += 1
            self.sent[peer] += _nbytes(tensors)
        else:
            self.recv_messages += 1
            self.received[peer] += _nbytes(tensors)
            self.last_received = tensors

    def wire(self):
        last = [t.detach().clone() for t in self.last_received or ()]
        return {"sent_messages": self.sent_messages, "sent_bytes": sum(self.sent.values()),
                "recv_messages": self.recv_messages, "recv_bytes": sum(self.received.values()),
                "sent_to": dict(self.sent), "recv_from": dict(self.received),
                "last_received": last[0] if len(last) == 1 else None}

    def as_dict(self):
        """``comm``'s report with the wire's point-to-point counts, and :data:`BROKEN`
        (why) when the seal broke."""
        counted, wire = self.stats.as_dict(), self.wire()
        over = [f"{key}: comm {counted[key]}, wire {wire[key]}" for key in P2P_FIELDS
                if counted[key] > wire[key]]
        over += [f"{key} peer {peer}: comm {n}, wire {wire[key].get(peer, 0)}"
                 for key in ("sent_to", "recv_from") for peer, n in counted[key].items()
                 if n > wire[key].get(peer, 0)]
        report = {**counted, **wire}
        why = self.broken + (["course_lib.comm counted traffic that never went out ("
                              + "; ".join(over) + ")"] if over else [])
        if why:
            report[BROKEN] = "; ".join(why)
        if self.p2p_only and self.collective_calls:
            report[NOT_P2P] = ", ".join(sorted(self.collective_calls))
        return report


def _wrapped(method, traffic, sending, anysource=False):
    def counted(group, tensors, *args, **kwargs):
        peer = -1 if anysource else (args[0] if args else kwargs.get("dstRank",
                                                                      kwargs.get("srcRank")))
        traffic.add(sending, tensors, peer)
        return method(group, tensors, *args, **kwargs)
    return counted


def _collective(method, traffic, name):
    def counted(group, *args, **kwargs):
        traffic.collective_calls[name] += 1
        return method(group, *args, **kwargs)
    return counted


@contextmanager
def counting(p2p_only=False):
    """``comm.counting()``, with the point-to-point traffic counted on the wire (see the
    module); yields a :class:`Traffic`. ``p2p_only``: the exercise is built from
    point-to-point messages, and a collective of the process group (torch's
    ``all_gather``, ``broadcast``...) called in the block is reported (:data:`NOT_P2P`)."""
    from course_lib import comm

    with comm.counting() as stats:
        traffic = Traffic(stats, p2p_only)
        placed = []
        wrappers = {"send": lambda m: _wrapped(m, traffic, True),
                    "recv": lambda m: _wrapped(m, traffic, False),
                    "recv_anysource": lambda m: _wrapped(m, traffic, False, anysource=True),
                    **{name: (lambda m, n=name.strip("_"): _collective(m, traffic, n))
                       for name in COLLECTIVES}}
        for cls in _classes():
            for name, wrap in wrappers.items():
                method = cls.__dict__.get(name)
                if method is not None:
                    wrapper = wrap(method)
                    setattr(cls, name, wrapper)
                    placed.append((cls, name, method, wrapper))
        try:
            yield traffic
        finally:
            for cls, name, method, wrapper in reversed(placed):
                if cls.__dict__.get(name) is not wrapper:
                    traffic.broken.append(f"{cls.__name__}.{name} was replaced")
                setattr(cls, name, method)


@contextmanager
def watch(traffic, module=None, names=()):
    """Break ``traffic``'s seal when, after the block, a torch dispatch mode in force at
    its start (a FLOP counter, an operation log) is no longer, or ``module``'s
    attributes ``names`` (the job's wrappers) were replaced."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = list(_get_current_dispatch_mode_stack())
    placed = {name: getattr(module, name) for name in names}
    try:
        yield
    finally:
        now = _get_current_dispatch_mode_stack()
        if len(now) < len(modes) or any(a is not b for a, b in zip(modes, now)):
            traffic.broken.append("a dispatch mode the check counts with was taken off")
        traffic.broken += [f"{module.__name__}.{name} was replaced"
                           for name, wrapper in placed.items() if getattr(module, name) is not wrapper]


def broken(answer, key=BROKEN):
    """Why the seal broke (or, ``key=NOT_P2P``, the collectives called), if any part of
    ``answer`` (decoded plain data) says so."""
    if isinstance(answer, dict):
        if isinstance(answer.get(key), str):
            return answer[key]
        answer = list(answer.values())
    if isinstance(answer, (list, tuple)):
        for part in answer:
            why = broken(part, key)
            if why:
                return why
    return None
