"""Exercise 8.7, a restart of per-stage pipeline checkpoints, designed: the student's
``latest_complete(root, n_stages)`` (graded by :mod:`.stages`) and
``plan_restart(root, n_stages, keep)``, the plan a restart follows before its first save:
``(resume, remove)``, the step directory to resume from (``latest_complete``'s) and the
step directories to delete.

What the plan must be follows from three facts the lab gives: a save refuses a committed
directory (Exercise 8.3), only a complete step can be resumed from, and the disk holds
``keep`` checkpoints. So the plan keeps the ``keep`` newest complete steps and removes
every other ``step_<t>`` directory: a step newer than the resumed one is the dead run's
(the resumed run saves that step again: a committed stage there would refuse the save,
and leftover files would mix two runs); an incomplete one can never be loaded, and a
complete one older than the ``keep`` newest only takes disk. Nothing but step
directories is touched. With no complete step, the run starts over and every step
directory goes.

The harness builds each root as :mod:`.stages` does and answers with names relative to it;
the check works out each expected plan from the scenario itself.
"""
from __future__ import annotations

from pathlib import Path

from course_lib.grading import checks
from course_lib.grading.lab08 import stages
from course_lib.grading.lab08.stages import built_roots  # the harness travels by value
from course_lib.grading.requests import here

EX_RESTART = stages.EX_STAGES
KEEP = 2

__all__ = ["check_restart", "restart_answers", "expected_plan"]


def _name(path, root):
    if path is None:
        return None
    if not isinstance(path, Path):
        raise TypeError(f"a {type(path).__name__}, not a pathlib.Path")
    return path.relative_to(root).as_posix()


def restart_answers(plan_restart, scenarios, keep):
    """Each scenario built afresh and planned by ``plan_restart(root, n, keep)``: [{"value":
    (resume name or None, sorted names to remove)} | {"raised": ...} | {"invalid": ...}]."""
    answers = []
    for root, n_stages in built_roots(scenarios, "lab08-restart-"):
        try:
            resume, remove = plan_restart(root, n_stages, keep)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the answer, for the check to judge
            answers.append({"raised": type(exc).__name__, "message": str(exc)[:300]})
            continue
        try:
            answers.append({"value": (_name(resume, root), sorted(_name(p, root) for p in remove))})
        except (TypeError, ValueError) as exc:
            answers.append({"invalid": f"{type(exc).__name__}: {exc}"[:300]})
    return answers


def expected_plan(entries, n_stages, keep):
    """(resume name or None, sorted step names to remove) for a root of ``entries``."""
    steps = sorted((int(stages.STEP.fullmatch(k).group(1)), k) for k in entries or {}
                   if stages.STEP.fullmatch(k) and entries[k] != "file")
    complete = [name for _, name in steps if entries[name][:n_stages] == "c" * n_stages]
    kept = complete[-keep:] if complete else []
    return (kept[-1] if kept else None), sorted(name for _, name in steps if name not in kept)


def drawn(rng):
    return {**stages.drawn_scenarios(rng), "keep": rng.choice((1, 2, 3))}


@checks.check(EX_RESTART, hidden=drawn)
def check_restart(latest_complete, plan_restart, scenarios=tuple(stages.SCENARIOS),
                  keep=KEEP):
    detail = yield from stages.check_latest_complete.steps(latest_complete, scenarios)
    answers = yield here(restart_answers, plan_restart, scenarios, keep)
    for (label, n, entries), answer in zip(scenarios, answers):
        call = f"plan_restart(root, {n}, keep={keep}) on {label}"
        if entries:
            call += f": {entries}"
        if "invalid" in answer:
            raise checks.CheckFailed(f"{EX_RESTART}: {call} returned a path that is not a "
                                     f"pathlib.Path inside root ({answer['invalid']})")
        resume, remove = checks.answer_value(EX_RESTART, call, answer)
        want = expected_plan(entries, n, keep)
        if (resume, remove) != want:
            raise checks.CheckFailed(
                f"{EX_RESTART}: {call} planned resume={resume!r}, remove={remove}; expected "
                f"resume={want[0]!r}, remove={want[1]}.\nWhy: "
                f"{_mistake(resume, remove, want, entries, n, keep)}")
    return (f"{detail}; and the restart plan on each root, keeping the {keep} newest "
            f"complete steps")


def _mistake(resume, remove, want, entries, n, keep):
    twice = sorted({k for k in remove if remove.count(k) > 1})
    if twice:
        return f"{twice[0]} is listed twice: each directory to remove once"
    if resume != want[0]:
        return "resume from the newest step every stage committed (latest_complete)"
    entries = entries or {}
    others = [k for k in remove if not stages.STEP.fullmatch(k) or k not in entries
              or entries[k] == "file"]
    if others:
        return f"{others[0]} is not a step directory: the plan touches step_<t> only"
    number = {k: int(stages.STEP.fullmatch(k).group(1)) for k in entries
              if stages.STEP.fullmatch(k)}
    newest = number[resume] if resume else -1
    kept_newer = [k for k in want[1] if k not in remove and number[k] > newest]
    if kept_newer:
        return (f"{kept_newer[0]} is newer than the step resumed, a save of the run that "
                f"died: the resumed run saves that step again, and a committed stage left "
                f"there would refuse its save (Exercise 8.3), leftover files would mix two "
                f"runs")
    removed_kept = [k for k in remove if k not in want[1]]
    if removed_kept:
        return (f"{removed_kept[0]} is one of the {keep} newest complete steps: keep them, "
                f"a fallback if the newest turns out unreadable")
    left = [k for k in want[1] if k not in remove]
    if not left:
        return "the plan differs from the expected one"
    if entries[left[0]][:n] != "c" * n:
        return (f"{left[0]} is incomplete and older than the step resumed: no restart can "
                f"load it, remove it")
    return (f"{left[0]} is complete but older than the {keep} newest complete steps: "
            f"remove it (the disk holds only so many checkpoints)")
