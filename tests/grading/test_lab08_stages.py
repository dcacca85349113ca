"""Exercise 8.7's check: the solution passes (also as the gradebook's judge decides), the
stub and each plausible wrong answer fail with its own reason; the library's
latest_complete passes the comparison and is refused by the judge."""
import random
import re
from pathlib import Path

import pytest

from conftest import judged, ship_by_value
from course_lib.checkpoint.files import is_committed
from course_lib.grading import checks
from course_lib.grading.lab08.stages import SCENARIOS, check_latest_complete, expected

ship_by_value(__name__)


def latest_complete(root, n_stages, count=all, exists=False, by_name=False, check_root=True,
                    as_str=False):
    root = Path(root)
    if check_root and not root.is_dir():
        return None
    steps = []
    for child in root.iterdir():
        found = re.fullmatch(r"step_(\d+)", child.name)
        there = [child / f"stage_{s:03d}" for s in range(n_stages)]
        done = [p.is_dir() if exists else is_committed(p) for p in there]
        if found and count(done):
            steps.append((child.name if by_name else int(found.group(1)), child))
    if not steps:
        return None
    return str(max(steps)[1]) if as_str else max(steps)[1]


def test_the_expectations_follow_the_scenarios():
    assert [expected(entries, n) for _, n, entries in SCENARIOS] == [
        None, None, "step_10", "step_10", "step_10", "step_10", "step_000020", "step_100",
        "step_5", "step_20", "step_1", None, "step_3"]


def test_the_solution_passes_as_judged(sandbox):
    assert "steps 99 and 100 unpadded" in judged(sandbox, check_latest_complete,
                                                 latest_complete, seed=7)
    for seed in range(10):  # the gradebook's hidden roots
        check_latest_complete(latest_complete, **check_latest_complete.hidden(random.Random(seed)))


def only_the_newest(root, n_stages):
    root = Path(root)
    steps = sorted((int(p.name[5:]), p) for p in root.iterdir() if re.fullmatch(r"step_\d+",
                                                                                   p.name)) \
        if root.is_dir() else []
    if steps and all(is_committed(steps[-1][1] / f"stage_{s:03d}") for s in range(n_stages)):
        return steps[-1][1]
    return None


def every_name_a_step(root, n_stages):
    root = Path(root)
    if not root.is_dir():
        return None
    steps = [(int(p.name.split("_")[1]), p) for p in root.iterdir()]
    steps = [(t, p) for t, p in steps
             if all(is_committed(p / f"stage_{s:03d}") for s in range(n_stages))]
    return max(steps)[1] if steps else None


@pytest.mark.parametrize("wrong, reason", [
    (lambda r, n: latest_complete(r, n, count=any), "step_20 has no directory stage_002: "
                                                    "that stage never saved this step"),
    (lambda r, n: latest_complete(r, n, exists=True), "step_20/stage_002 holds data but no "
                                                      "COMMITTED marker"),
    (lambda r, n: latest_complete(r, n, by_name=True), r"step_100 is newer than step_99: "
                                                       r"compare the step numbers"),
    (lambda r, n: latest_complete(r, n, check_root=False), "raised FileNotFoundError.*a root "
                                                           "that does not exist.*return None"),
    (lambda r, n: latest_complete(r, n, as_str=True), "returned the str .*as a pathlib.Path"),
    (only_the_newest, "step_10 has all 3 stages committed: when the newest step is not "
                      "complete, go back"),
    (every_name_a_step, "raised IndexError.*leave out the entries that are not "
                        r"step_<number> directories"),
    (lambda r, n: latest_complete(r, n) / "stage_000" if latest_complete(r, n) else None,
     r"return the directory of the step, root / 'step_<t>' \(not a stage's directory"),
])
def test_wrong_answers_fail_with_their_reason(wrong, reason):
    with pytest.raises(checks.CheckFailed, match="Exercise 8.7: latest_complete") as info:
        check_latest_complete(wrong)
    assert re.search(reason, str(info.value), re.S), str(info.value)


def test_the_stub_says_not_implemented():
    def stub(root, n_stages):
        raise NotImplementedError

    with pytest.raises(NotImplementedError, match="Exercise 8.7 is not implemented"):
        check_latest_complete(stub)


def test_the_library_passes_the_comparison(capsys):
    from course_lib.checkpoint.pipeline import latest_complete as library

    check_latest_complete(library)
    assert "✓ Exercise 8.7 passed" in capsys.readouterr().out


def test_the_library_is_refused(sandbox):
    from course_lib.checkpoint.pipeline import latest_complete as library

    with pytest.raises(checks.CheckFailed, match="course_lib.s own implementation"):
        judged(sandbox, check_latest_complete, library)
