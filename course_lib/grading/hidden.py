"""Hidden settings (door 5 of issue 30): what every check also runs on in the gradebook.

A check declares ``hidden(rng)`` (:func:`course_lib.grading.checks.check`): options for
one more run, drawn from a :class:`random.Random` seeded by the class's secret, the
student and the exercise (:func:`seed`). The judge runs it after the visible settings
pass (:func:`drive`); a failure there is told with the drawn numbers masked
(:func:`failure`), so feedback never hands a student the settings to tabulate. Checks
seeded through torch draw a salt instead (:mod:`course_lib.grading.salt`).

The secret is the instructor's (:func:`class_secret`): a file beside the gradebook,
never in the sandbox, or ``COURSE_LIB_GRADING_SECRET``; regrading the class with it
draws the same settings.
"""
from __future__ import annotations

import hashlib
import os
import random
import re
from pathlib import Path

from course_lib.grading import checks, ids, salt

SECRET_FILE = "hidden-settings.key"
_NUMBER = re.compile(r"\d[\d,_]*(\.\d+)?(e[+-]?\d+)?")
_LONG_NUMBER = re.compile(r"\d[\d,_]*\d(\.\d+)?(e[+-]?\d+)?|\d\.\d+(e[+-]?\d+)?")


def class_secret(path):
    """The secret behind the hidden settings: ``COURSE_LIB_GRADING_SECRET``, else the
    file ``path`` (made, readable by its owner only, the first time)."""
    if os.environ.get("COURSE_LIB_GRADING_SECRET"):
        return os.environ["COURSE_LIB_GRADING_SECRET"]
    path = Path(path)
    if not path.exists():  # written whole, then linked: slices starting together agree
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f".{path.name}.{os.urandom(6).hex()}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(16).hex() + "\n")
        try:
            os.link(draft, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(draft)
    return path.read_text().strip()


def seed(secret, student, exercise):
    """The seed of ``exercise``'s hidden settings for ``student``: the class's secret
    decides it, so a student cannot work it out."""
    text = f"{secret}\0{student}\0{ids.normalize(exercise)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def failure(exercise, exc):
    """What a failure on the hidden settings says: what went wrong, with the setting's
    numbers masked (every number of the first line, those of two digits or more after
    it), so that feedback never shows the drawn values."""
    first, _, rest = str(exc).partition("\n")
    first = _NUMBER.sub("#", first.removeprefix(f"{exercise}: "))
    rest = _LONG_NUMBER.sub("#", rest)
    return (f"{exercise}: the settings shown in the notebook passed, but settings the grader "
            f"drew for this submission (not shown) did not: {first}" + (f"\n{rest}" if rest else ""))


def drive(check, students, options, drawn_from, answer):
    """Run ``check`` on the settings ``check.hidden`` draws from seed ``drawn_from`` (a
    salted check at its largest world size), answering its requests with ``answer``;
    raises CheckFailed told by :func:`failure`."""
    drawn = check.hidden(random.Random(drawn_from))
    if salt.KEY in drawn:
        drawn = {**salt.one_world(check.steps, options), **drawn}
    salted = salt.salted(drawn.pop(salt.KEY, 0))  # torch's seeds, here and where it runs
    try:
        with salted:
            checks.drive(check.steps(*students, **{**options, **drawn}), answer)
    except checks.CheckFailed as exc:
        raise checks.CheckFailed(failure(check.exercise, exc), exercise=check.exercise) from None
