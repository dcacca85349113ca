"""How a job failed, explained from what its ranks left (Lab 00's launcher): the records of
the ranks that raised, the ranks that died silently, torchrun's own summary. No process
or folder is touched here: the job (:mod:`course_lib.runtime.job`) reads those and hands
them over.

A rank that raises writes a record (its traceback). The ranks torchrun then ends with
SIGTERM write a mark from the signal handler. A rank that left neither, nor a result,
died from outside (SIGKILL, the out-of-memory killer, a crash in C code, an abort).
The cause named first is ranked, not merely the earliest (:func:`cause_rank`): a rank's
own exception (an NCCL rule, the student's error), then a death with no word, then a
peer's complaint that a connection broke. So a rank killed while its peers wait is named
before their broken connections, and a rule one rank raised is named before the abort
of its peer that followed (a silent death has no time to sort by). A hang is told from
every rank's stack (:func:`timeout_error`).
"""
from __future__ import annotations

import re
import signal

from course_lib.runtime.hangs import diagnose_hang
from course_lib.runtime.shipped import Shipped

__all__ = ["LaunchError", "LaunchTimeout", "explain", "failure", "cause_rank", "timeout_error",
           "gave_up", "interrupted"]


class LaunchError(RuntimeError):
    """A rank failed. ``.ranks`` lists the failed ranks, ``.errors`` their records
    (rank, type, message, traceback) in the order they failed; ``.port`` is the
    job's rendezvous port (free again by the time you see this)."""

    port = None

    def __init__(self, message, ranks=(), errors=(), log=""):
        super().__init__(message)
        self.ranks = list(ranks)
        self.errors = list(errors)
        self.log = log

    @property
    def exc_type(self):
        """Exception class name of the first rank that failed, or None."""
        return self.errors[0]["type"] if self.errors else None


class LaunchTimeout(LaunchError):
    """The job outlived its timeout. ``.stacks`` maps rank -> Python stack dump."""

    def __init__(self, message, ranks=(), stacks=None, log=""):
        super().__init__(message, ranks=ranks, log=log)
        self.stacks = dict(stacks or {})


def explain(errors, silent, log):
    """The :class:`LaunchError` for what a job's ranks left, or None when they left nothing:
    ``errors``, the records of the ranks that raised; ``silent``, the ranks that died with
    no word (no record, no result, no mark of torchrun's SIGTERM); ``log``, torchrun's
    lines, whose failure summary says which signal ended a silent rank."""
    signals = _signalled_ranks(log)
    errors = list(errors) + [_silent_death(rank, signals.get(rank)) for rank in silent]
    return failure(errors, log) if errors else None


def _signalled_ranks(log):
    """{rank: signal number} of the ranks torchrun's summary says a signal ended."""
    text = "".join(log)
    at = text.rfind("Root Cause (first observed failure)")
    found = re.finditer(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", text[at:], re.S) \
        if at >= 0 else ()
    return {int(m.group(1)): -int(m.group(2)) for m in found if int(m.group(2)) < 0}


_WHY = {signal.SIGKILL: "killed (by hand, by the out-of-memory killer, or with its node)",
        signal.SIGSEGV: "a crash in C code (a segmentation fault)",
        signal.SIGBUS: "a crash in C code (a bus error)",
        signal.SIGABRT: "an abort (a C++ exception that was not caught, or NCCL's watchdog)"}


def _silent_death(rank, code):
    """The record of a rank that died without writing one."""
    if code is None:
        name, how = "a signal", ("it ended leaving no traceback, and torchrun had not stopped "
                                 "it: killed (SIGKILL, the out-of-memory killer), crashed in "
                                 "C code, or ended by os._exit")
    else:
        try:
            name = signal.Signals(code).name
        except ValueError:
            name = f"signal {code}"
        how = (f"it was ended by {name} (signal {code}) and left no traceback: "
               f"{_WHY.get(code, 'sent by another process')}")
    return {"rank": rank, "type": name, "time": 0.0, "traceback": "", "message": how,
            "silent": True}


def interrupted(stacks, nproc, shipped=None):
    """What to print after the student stopped a job (the kernel's stop button, Ctrl-C):
    where each live rank was, as a timeout would say (a job that never ends is the usual
    reason to stop one)."""
    diagnosis = diagnose_hang(stacks, nproc, shipped or Shipped())
    return f"Interrupted: the job was stopped.\n{diagnosis.explain()}"


def timeout_error(timeout, nproc, stacks, log, shipped=None):
    """A :class:`LaunchTimeout` whose message says where each rank was, trimmed to
    the student's code, and what kind of hang that is (:func:`diagnose_hang`).
    The untrimmed dumps stay in ``.stacks``, the analysis is ``.diagnosis``."""
    diagnosis = diagnose_hang(stacks, nproc, shipped or Shipped())
    message = (f"the job did not finish within timeout={timeout:g}s and was stopped.\n"
               f"{diagnosis.explain()}")
    error = LaunchTimeout(message, ranks=sorted(stacks), stacks=stacks, log="".join(log))
    error.diagnosis = diagnosis
    return error


# what a rank raises when a peer went away before it: gloo's broken pairs, the store's
# lost client, torch's distributed errors; a consequence of the cause, never the cause
_PEER_GONE = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|ECONNRESET|EPIPE|"
                        r"Socket Timeout|failed to recv|Connection refused", re.I)
_PEER_GONE_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError"}


def cause_rank(error):
    """How surely a rank's record names the job's cause, most sure first: 0 the rank's own
    exception (an NCCL rule, the student's error), 1 a death that left no word (a signal,
    :func:`_silent_death`), 2 an exception saying a peer or the store went away."""
    if error.get("silent"):
        return 1
    if error["type"] in _PEER_GONE_TYPES or _PEER_GONE.search(error.get("message") or ""):
        return 2
    return 0


def failure(errors, log, reason=None):
    errors = sorted(errors, key=lambda e: (cause_rank(e), e["time"]))
    if errors:
        first = errors[0]
        others = [e["rank"] for e in errors[1:]]
        msg = f"rank {first['rank']} failed with {first['type']}: {first['message']}\n"
        if first["traceback"]:
            msg += f"\nTraceback of rank {first['rank']}:\n{first['traceback']}"
        if others:
            msg += f"\n(ranks {others} failed as well, probably as a consequence)"
        return LaunchError(msg, ranks=sorted(e["rank"] for e in errors), errors=errors,
                           log="".join(log))
    tail = "".join(log[-40:])
    return LaunchError(f"{reason}. Launcher output:\n{tail}", log="".join(log))


def gave_up(returncode, max_restarts):
    """Why a job failed when no rank of its last attempt left a record."""
    reason = f"torchrun exited with status {returncode} and no rank reported an error"
    if max_restarts:
        reason += (f" in its last attempt (the ranks were started {max_restarts + 1} times, "
                   f"max_restarts={max_restarts}; a rank ended by a signal, SIGKILL or "
                   "out of memory, leaves no record: look for 'Signal' and 'exitcode' below)")
    return reason
