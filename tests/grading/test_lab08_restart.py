"""Exercise 8.7's restart plan: the solution passes (also as the gradebook's judge decides,
and on the hidden roots and keeps), each plausible wrong plan fails with its own reason,
and the library's plan passes the comparison and is refused by the judge."""
import random
import re
from pathlib import Path

import pytest

from conftest import judged, ship_by_value
from course_lib.checkpoint.files import is_committed
from course_lib.grading import checks
from course_lib.grading.lab08.restart import check_restart, expected_plan
from course_lib.grading.lab08.stages import SCENARIOS

ship_by_value(__name__)


def _steps(root):
    root = Path(root)
    found = [(re.fullmatch(r"step_(\d+)", p.name), p) for p in root.iterdir()] \
        if root.is_dir() else []
    return sorted((int(m.group(1)), p) for m, p in found if m and p.is_dir())


def _complete(path, n_stages):
    return all(is_committed(path / f"stage_{s:03d}") for s in range(n_stages))


def latest_complete(root, n_stages):
    done = [p for _, p in _steps(root) if _complete(p, n_stages)]
    return done[-1] if done else None


def plan_restart(root, n_stages, keep, mistake=None):
    steps = _steps(root)
    complete = [p for _, p in steps if _complete(p, n_stages)]
    kept = complete[-keep:] if complete else []
    resume = kept[-1] if kept else None
    if mistake == "keeps newer":  # only what is older than the resumed step may go
        newest = int(resume.name[5:]) if resume else float("inf")
        return resume, [p for t, p in steps if p not in kept and t < newest]
    if mistake == "keeps incomplete":  # the older incomplete steps stay
        newest = int(resume.name[5:]) if resume else -1
        return resume, [p for t, p in steps if p not in kept and (t > newest or p in complete)]
    if mistake == "counts incomplete toward keep":  # the last keep steps up to resume
        newest = int(resume.name[5:]) if resume else -1
        window = [p for t, p in steps if t <= newest][-keep:]
        kept = [p for p in window if p in complete]
        return resume, [p for _, p in steps if p not in kept]
    if mistake == "twice":
        newest = int(resume.name[5:]) if resume else -1
        return resume, [p for t, p in steps if p not in kept] + \
            [p for t, p in steps if t > newest]
    if mistake == "only the resumed":
        return resume, [p for _, p in steps if p != resume]
    if mistake == "removes everything else":
        return resume, [p for p in Path(root).iterdir() if p not in kept] \
            if Path(root).is_dir() else []
    if mistake == "as strings":
        return resume, [str(p) for _, p in steps if p not in kept]
    return resume, [p for _, p in steps if p not in kept]


def test_the_expected_plans_follow_the_scenarios():
    plans = {label: expected_plan(entries, n, 2) for label, n, entries in SCENARIOS}
    assert plans["a root that does not exist"] == (None, [])
    assert plans["the newest two steps incomplete"] == ("step_10", ["step_20", "step_30"])
    assert plans["steps 99 and 100, not zero-padded"] == ("step_100", [])
    assert plans["four stages"] == ("step_1", ["step_2", "step_3"])
    assert plans["no step complete"] == (None, ["step_10", "step_20"])
    assert plans["older steps, complete and not"] == ("step_3", ["step_2", "step_4"])
    assert plans["other entries beside the steps"] == ("step_5", ["step_8"])
    assert expected_plan({"step_1": "cc", "step_2": "cc", "step_3": "cc"}, 2, 1) == \
        ("step_3", ["step_1", "step_2"])


def test_the_solution_passes_as_judged(sandbox):
    assert "the restart plan on each root" in judged(sandbox, check_restart, latest_complete,
                                                     plan_restart, seed=7)
    for seed in range(10):  # the gradebook's hidden roots and keeps
        check_restart(latest_complete, plan_restart, **check_restart.hidden(random.Random(seed)))


@pytest.mark.parametrize("mistake, reason", [
    ("keeps newer", "newer than the step resumed, a save of the run that died"),
    ("keeps incomplete", "incomplete and older than the step resumed"),
    ("only the resumed", "one of the 2 newest complete steps"),
    ("counts incomplete toward keep", "step_1 is one of the 2 newest complete steps"),
    ("twice", "is listed twice"),
    ("removes everything else", "is not a step directory"),
    ("as strings", "not a pathlib.Path"),
])
def test_wrong_plans_fail_with_their_reason(mistake, reason):
    with pytest.raises(checks.CheckFailed, match="Exercise 8.7: plan_restart") as info:
        check_restart(latest_complete, lambda r, n, k: plan_restart(r, n, k, mistake))
    assert re.search(reason, str(info.value), re.S), str(info.value)


def test_a_wrong_latest_complete_fails_first():
    with pytest.raises(checks.CheckFailed, match="Exercise 8.7: latest_complete"):
        check_restart(lambda root, n: None, plan_restart)


def test_the_library_passes_the_comparison_and_is_refused_by_the_judge(sandbox, capsys):
    from course_lib.checkpoint.pipeline import plan_restart as library

    check_restart(latest_complete, library)
    assert "✓ Exercise 8.7 passed" in capsys.readouterr().out
    with pytest.raises(checks.CheckFailed, match="course_lib.s own implementation"):
        judged(sandbox, check_restart, latest_complete, library)
