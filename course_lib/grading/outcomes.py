"""How each exercise's last check ended in this process, and the failure a check raises.

A check records ``"checking"`` when it starts and ``"passed"`` when it passes; a
:class:`CheckFailed` records ``"failed"`` as it is made. A measurement cell asks
:func:`ready` before it runs the student's code, so it skips, saying so, code whose
check failed instead of hanging on it.
"""
from __future__ import annotations

import threading

from course_lib.grading import ids

# exercise -> "passed", "failed" or "checking" (a check started and has not passed: it
# raised something other than CheckFailed, or was interrupted; cells run one at a time).
_outcomes: dict = {}
_outcomes_lock = threading.Lock()
_key = ids.normalize


def _record(exercise, outcome):
    if exercise:
        with _outcomes_lock:
            _outcomes[_key(exercise)] = outcome


def outcome(exercise):
    """How the last check of ``exercise`` in this process ended: ``"passed"``,
    ``"failed"``, ``"checking"`` (started, never passed: it raised or was
    interrupted) or None (never checked)."""
    with _outcomes_lock:
        return _outcomes.get(_key(exercise))


def ready(exercise):
    """May a measurement cell run the student's code for ``exercise``? True when its
    last check in this kernel passed, or when it was never checked here (silently);
    False, after printing one line saying so, when that check failed."""
    state = outcome(exercise)
    if state in (None, "passed"):
        return True
    print(f"{_key(exercise)} did not pass its check in this kernel: skipping this "
          f"measurement; fix it and run its check cell again")
    return False


class CheckFailed(AssertionError):
    """The student's code ran but gave a wrong answer (or hung, or crashed).
    ``.exercise`` is the exercise it is about (given, or read from the message's
    leading "Exercise N.M"); creating one records a failure of that exercise.
    After a hang, ``.stacks`` holds every rank's untrimmed stack dump and
    ``.diagnosis`` the :class:`~course_lib.runtime.hangs.HangDiagnosis`."""

    stacks = None
    diagnosis = None

    def __init__(self, message="", *args, exercise=None):
        super().__init__(message, *args)
        found = ids.IN_MESSAGE.match(str(message))
        self.exercise = _key(exercise) if exercise else (found.group(1) if found else None)
        _record(self.exercise, "failed")
