"""``course_lib.grading.checks`` in a graded submission's sandbox: only what the notebook's
own cells ask of it (:func:`ready`, :func:`outcome`), answered with what the judge
decided (the collector records each check's verdict here as it comes)."""
PASS_MARK = "✓"
_outcomes: dict = {}


def _key(exercise):
    return " ".join(str(exercise).split())


def _record(exercise, state):
    if exercise:
        _outcomes[_key(exercise)] = state


def outcome(exercise):
    """How the judge decided ``exercise``'s check: "passed", "failed" or None (not yet)."""
    return _outcomes.get(_key(exercise))


def ready(exercise):
    """May a demo cell run the student's code for ``exercise``? Not when its check failed."""
    state = outcome(exercise)
    if state in (None, "passed"):
        return True
    print(f"{_key(exercise)} did not pass its check: skipping this measurement")
    return False
