"""Reading a hung rank's Python stacks (faulthandler dumps) as a student should see them.

:func:`rank_state` parses one rank's dump into a :class:`RankState`: which call
it waits in (a collective, a send/recv, a wait) and from which library, the
student's innermost frame and its source line, and a trimmed stack that starts
at the student's outermost frame and ends at the library call, without the
launcher's, the checker's or helper threads' frames. :mod:`course_lib.runtime.hangs`
reads the states of all ranks together.
"""
from __future__ import annotations

import linecache
from dataclasses import dataclass

from course_lib.runtime.dumps import (COLLECTIVE_OPS, Frame, first_op, from_the_worker,
                                      main_thread, op_kind, parse_dump, started_by_threading)


def trim_stack(text, getline=linecache.getline):
    """One rank's faulthandler dump as a student should see it: its main thread from
    the student's outermost frame down to the library call it waits in (most recent
    call last, as in a traceback), and any thread the student started. Left out:
    the launcher's and the checker's frames, the library's frames between the call
    and the innermost one, and helper threads (the launcher's watcher, the waiters
    of handles and traces, idle pools)."""
    return rank_state(0, text, getline).stack


_WRAPPERS = frozenset({"wrapper", "inner", "decorate_context", "_fn"})  # decorators' frames


def ranks_phrase(ranks):
    """"rank 1", "ranks 0 and 2", "ranks 0, 1 and 3"."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


@dataclass
class RankState:
    """Where one rank of a hung job was, read from its stack.

    ``status``: ``blocked`` (in a communication call made by the student's code),
    ``busy`` (running the student's code, in no communication call), ``in-check``
    (in the checker's own code, outside the student's function), ``finished`` (had
    returned from the function; idle between calls), ``starting`` (in the
    launcher's code, not yet in the function) or ``exited`` (no stack).
    ``op``: the call it waits in (``all_reduce``, ``recv``, ``wait``...); ``kind``:
    ``collective``, ``p2p`` or ``wait`` (a handle's wait on something unknown);
    ``library``: where that call lives; ``caller``/``source``: the student's
    innermost frame and its line of code; ``place``: the checker's or launcher's
    frame it is in; ``stack``: the trimmed stack shown to the student."""
    rank: int
    status: str
    op: str | None = None
    kind: str | None = None
    library: str | None = None
    detail: str = ""
    caller: Frame | None = None
    source: str = ""
    place: Frame | None = None
    stack: str = ""

    @property
    def left(self):
        """No longer (or not yet) inside the student's code."""
        return self.status in ("finished", "exited", "in-check", "starting")

    def at(self):
        if self.caller is None:
            return ""
        return (f" at {self.caller.func}, line {self.caller.line}"
                + (f": {self.source}" if self.source else ""))

    def describe(self, plural=False):
        """What the rank did, as the rest of a sentence that starts "rank R"."""
        verb = (lambda one, many: many if plural else one)  # noqa: E731
        if self.status == "blocked":
            extra = f", {self.detail}" if self.detail else ""
            return f"{verb('waits', 'wait')} in {self.op}() ({self.library}{extra}){self.at()}"
        if self.status == "busy":
            inside = f" (inside {self.place.library}.{self.place.func})" if self.place else ""
            return (f"{verb('is', 'are')} still running your code, in no communication "
                    f"call{inside}{self.at()}")
        if self.status == "in-check":
            what = f"the check's own {self.op}()" if self.op else "the check's own code"
            where = f" ({self.place.short()}, in {self.place.func})" if self.place else ""
            return f"{verb('is', 'are')} outside your function, in {what}{where}"
        if self.status == "finished":
            return "had already returned from your function"
        if self.status == "starting":
            where = f" ({self.place.short()}, in {self.place.func})" if self.place else ""
            return f"had not reached your function: still in the launcher's code{where}"
        return "had exited (no stack)"

    def brief(self, plural=False):
        """:meth:`describe` without the where: for a hint."""
        verb = (lambda one, many: many if plural else one)  # noqa: E731
        if self.status == "blocked":
            return f"{verb('is', 'are')} in {self.op}()"
        if self.status == "busy":
            return f"{verb('is', 'are')} still running your code, in no communication call"
        if self.status == "in-check":
            what = f"the check's own {self.op}()" if self.op else "the check's own code"
            return f"had left your function and {verb('is', 'are')} in {what}"
        if self.status == "starting":
            return "had not reached your function yet"
        return self.describe(plural)


def _source(frame, getline):
    """``getline(file, line)``, or a :class:`~course_lib.runtime.shipped.Shipped` (which
    knows the code a call shipped to its ranks)."""
    try:
        if hasattr(getline, "source"):
            return getline.source(frame)
        return (getline(frame.file, frame.line) or "").strip()
    except Exception:  # noqa: BLE001 - a line of source is a nicety
        return ""


def _format(frames, getline):
    """Frames (outermost first; None marks left-out frames) as traceback lines."""
    out = []
    for frame in frames:
        if frame is None:
            out.append("  ...")
        elif frame.origin == "user":
            file = getline.file_of(frame) if hasattr(getline, "file_of") else frame.file
            out.append(f'  File "{file}", line {frame.line}, in {frame.func}')
            source = _source(frame, getline)
            if source:
                out.append(f"    {source}")
        else:
            out.append(f'  File "{frame.short()}", line {frame.line}, in {frame.func}')
    return "\n".join(out)


def _shown(frames, last_user):
    """What to show of a thread whose student's code is ``frames[0..last_user]``:
    those frames (library runs of more than three between them cut to first ...
    last), then the library call the innermost one waits in and the innermost
    frame of all."""
    shown, run = [], []

    def flush():
        shown.extend(run if len(run) <= 3 else [run[0], None, run[-1]])
        run.clear()

    for frame in frames[:last_user + 1]:
        if frame.origin == "user":
            flush()
            shown.append(frame)
        else:
            run.append(frame)
    flush()
    chain = frames[last_user + 1:]
    at, _ = first_op(chain)
    call = chain[at] if at is not None else (chain[0] if chain else None)
    if call is not None:
        shown.append(call)
        index = chain.index(call)
        if index < len(chain) - 1:
            if index < len(chain) - 2:
                shown.append(None)
            shown.append(chain[-1])
    return shown


def _read_chain(state, chain, threads):
    """Fill ``state`` from the library frames below the student's innermost frame."""
    at, op = first_op(chain)
    if op is None:
        state.status, state.place = "busy", (chain[-1] if chain else None)
        return
    state.status, state.op, state.kind, state.library = "blocked", op, op_kind(op), \
        chain[at].library
    if state.kind == "wait":  # waiting on what? the helper threads know
        for _, frames in threads:
            if not started_by_threading(frames):
                continue
            if any(f.func == "_complete_when_done" for f in frames):
                state.kind, state.detail = "p2p", "on an isend/irecv"
            at, helper_op = first_op(frames)
            if helper_op in COLLECTIVE_OPS:
                state.op, state.kind = helper_op, "collective"
                state.library, state.detail = frames[at].library, "async_op=True, in its wait()"
                return


def rank_state(rank, text, getline=linecache.getline):
    """Classify and trim one rank's dump: a :class:`RankState`."""
    threads = parse_dump(text)
    state = RankState(rank, "exited")
    main = from_the_worker(main_thread(threads))
    if not main:
        state.stack = "  (no stack: the process had exited or did not answer)"
        return state
    users = [i for i, f in enumerate(main) if f.origin == "user"]
    if users:
        first, last = users[0], users[-1]
        state.caller, state.source = main[last], _source(main[last], getline)
        _read_chain(state, main[last + 1:], threads)
        shown = _format(_shown(main[first:], last - first), getline)
    else:
        shown = _without_student_frames(state, main, threads, getline)
    for _, frames in threads:  # threads the student started
        if frames is not main and started_by_threading(frames):
            mine = [i for i, f in enumerate(frames) if f.origin == "user"]
            if mine:
                shown += ("\n  another thread of this rank:\n"
                          + _format(_shown(frames[mine[0]:], mine[-1] - mine[0]), getline))
    state.stack = shown
    return state


def _without_student_frames(state, main, threads, getline):
    """A main thread with no frame of the student's: idle, starting, in the checker's
    own code, or in a library function passed as the function itself. Returns what
    to show."""
    outer = 0
    while outer < len(main) and main[outer].origin in ("runtime", "grading", "python"):
        outer += 1
    caller = main[outer - 1] if outer else None
    if outer == len(main):  # nothing but the launcher's and the checker's frames
        checker = [f for f in main if f.origin == "grading"]
        if main[-1].origin == "runtime" and main[-1].func == "_serve":
            state.status = "finished"
        elif checker:
            state.status, state.place = "in-check", checker[-1]
        elif main[-1].func == "_run_call":  # a builtin called as the function itself
            state.status = "busy"
        else:
            state.status, state.place = "starting", main[-1]
        return f"  (this rank {state.describe()})"
    chain = main[outer:]
    at, op = first_op(chain)
    direct = at is not None and all(f.func in _WRAPPERS for f in chain[:at])
    if caller is not None and caller.origin == "grading" and direct and \
            chain[at].origin == "torch":
        state.status, state.op, state.kind = "in-check", op, op_kind(op)
        state.library, state.place = chain[at].library, caller
        return f"  (this rank {state.describe()})"
    if caller is not None and caller.origin == "runtime" and caller.func != "_run_call":
        state.status, state.place = "starting", caller
        return f"  (this rank {state.describe()})"
    state.caller = chain[0]  # a library function under test: it stands for the student's
    _read_chain(state, chain[1:], threads)
    return _format(_shown(chain, 0), getline)
