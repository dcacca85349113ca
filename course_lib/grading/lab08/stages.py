"""Exercise 8.7, per-stage pipeline checkpoints: the student's ``latest_complete(root,
n_stages)``, the newest ``root/step_<t>`` directory in which every stage
``stage_000``, ..., ``stage_<n_stages - 1>`` (three digits, as ``save_stage`` names them)
holds the COMMITTED marker, or None.

A harness builds each scenario of :data:`SCENARIOS` in a temporary folder of the
student's process (real directories, data files and markers), calls the student's
function on it and answers with the name returned, relative to the root; the check
works out each expected answer from the scenario itself.
"""
from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from course_lib.checkpoint.files import COMMITTED, INDEX, data_file
from course_lib.grading import checks
from course_lib.grading.requests import here

EX_STAGES = "Exercise 8.7"
STEP = re.compile(r"step_(\d+)")

# (what it is, n_stages, the root's entries or None: no root). A step directory's string
# holds one letter per stage: "c" committed, "u" data but no marker, "-" no directory.
SCENARIOS = [
    ("an empty root", 3, {}),
    ("a root that does not exist", 3, None),
    ("one complete step", 3, {"step_10": "ccc"}),
    ("the newest step lacks a stage's directory", 3, {"step_10": "ccc", "step_20": "cc-"}),
    ("the newest step has a stage not committed", 3, {"step_10": "ccc", "step_20": "ccu"}),
    ("the newest two steps incomplete", 3,
     {"step_10": "ccc", "step_20": "c-c", "step_30": "ucc"}),
    ("zero-padded names, as save_stage writes them", 2,
     {"step_000010": "cc", "step_000020": "cc"}),
    ("steps 99 and 100, not zero-padded", 2, {"step_100": "cc", "step_99": "cc"}),
    ("other entries beside the steps", 3,
     {"notes.txt": "file", "tmp": "dir", "step_7": "file", "step_5": "ccc", "step_8": "cc-"}),
    ("one stage", 1, {"step_10": "cc", "step_20": "cu"}),
    ("four stages", 4, {"step_1": "cccc", "step_2": "cccu", "step_3": "-ccc"}),
    ("no step complete", 2, {"step_10": "c-", "step_20": "uc"}),
    ("older steps, complete and not", 2,
     {"step_1": "cc", "step_2": "c-", "step_3": "cc", "step_4": "-c"}),
]

__all__ = ["check_latest_complete", "stages_answers", "SCENARIOS"]


def stage(s):
    return f"stage_{s:03d}"


def _build(root, entries):
    root.mkdir(parents=True)
    for name, what in entries.items():
        if what == "file":
            (root / name).write_text("not a checkpoint\n")
        elif what == "dir":
            (root / name).mkdir()
        else:
            (root / name).mkdir()
            for s, letter in enumerate(what):
                if letter == "-":
                    continue
                (root / name / stage(s)).mkdir()
                (root / name / stage(s) / data_file(0)).write_bytes(bytes(16))
                if letter == "c":
                    (root / name / stage(s) / INDEX).write_text("{}")
                    (root / name / stage(s) / COMMITTED).write_bytes(b"")


def _answer(got, root):
    if got is None:
        return {"value": None}
    if not isinstance(got, Path):
        return {"type": type(got).__name__, "text": str(got)[:200]}
    try:
        return {"value": Path(got).relative_to(root).as_posix()}
    except ValueError:
        return {"outside": str(got)[:200]}


def drawn_scenarios(rng):
    """The gradebook's hidden roots: steps, stages and markers drawn."""
    scenarios = []
    for _ in range(3):
        n = rng.randint(1, 4)
        steps = rng.sample(range(1, 1000), rng.randint(1, 5))
        width = rng.choice((0, 6))  # plain or zero-padded, as save_stage writes them
        entries = {f"step_{t:0{width}d}" if width else f"step_{t}":
                   "".join(rng.choice("cccu-") for _ in range(n)) for t in steps}
        scenarios.append(("a drawn root", n, entries))
    return {"scenarios": tuple(scenarios)}


def built_roots(scenarios, prefix):
    """Each scenario's root built afresh in a temporary folder, removed at the end (or when
    the caller stops early): yields (root, n_stages)."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        for case, (_, n_stages, entries) in enumerate(scenarios):
            root = base / f"case{case}" / "ckpt"
            if entries is not None:
                _build(root, entries)
            yield root, n_stages
    finally:
        shutil.rmtree(base, ignore_errors=True)


def stages_answers(latest_complete, scenarios=tuple(SCENARIOS)):
    """Each scenario built afresh and handed to ``latest_complete``: [{"value": name
    relative to the root, or None} | {"raised": ...} | {"type": ...} | {"outside": ...}]."""
    answers = []
    for root, n_stages in built_roots(scenarios, "lab08-stages-"):
        try:
            answers.append(_answer(latest_complete(root, n_stages), root))
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the answer, for the check to judge
            answers.append({"raised": type(exc).__name__, "message": str(exc)[:300]})
    return answers


def expected(entries, n_stages):
    steps = [(int(STEP.fullmatch(k).group(1)), k) for k, v in (entries or {}).items()
             if STEP.fullmatch(k) and v[:n_stages] == "c" * n_stages]
    return max(steps)[1] if steps else None


@checks.check(EX_STAGES, hidden=drawn_scenarios)
def check_latest_complete(latest_complete, scenarios=tuple(SCENARIOS)):
    answers = yield here(stages_answers, latest_complete, scenarios)
    for (label, n, entries), answer in zip(scenarios, answers):
        why = _mistake(answer, entries, n)
        if why:
            shown = "" if not entries else (f": {entries} (a step's stages: c committed, u "
                                            f"data without {COMMITTED}, - no directory)")
            raise checks.CheckFailed(
                f"{EX_STAGES}: latest_complete(root, {n}) on {label}{shown} {_said(answer)}; "
                f"expected {_root(expected(entries, n))}.\nWhy: {why}")
    return (f"{len(scenarios)} roots: empty and missing, stages missing or not committed, "
            f"steps 99 and 100 unpadded, other entries, 1 to 4 stages")


def _root(name):
    return "None" if name is None else f"root / {name!r}"


def _said(answer):
    if "raised" in answer:
        return f"raised {answer['raised']}: {answer['message']}"
    if "type" in answer:
        return f"returned the {answer['type']} {answer['text']!r}"
    if "outside" in answer:
        return f"returned {answer['outside']!r}"
    return f"returned {_root(answer['value'])}"


def _mistake(answer, entries, n):
    want = expected(entries, n)
    if "raised" in answer:
        if entries is None:
            return ("a root that does not exist is a run that never saved: there is no "
                    "checkpoint, return None (check root.is_dir() before listing it)")
        if any(not STEP.fullmatch(k) for k in entries):
            return ("leave out the entries that are not step_<number> directories (a file "
                    "notes.txt, a directory tmp): match the name with re.fullmatch(r'step_"
                    "(\\d+)', name) before reading its number")
        return "find the newest step every stage committed; do not raise"
    if "type" in answer:
        return "return the step directory as a pathlib.Path (root / its name), or None"
    if "outside" in answer:
        return "return the step directory itself, root / its name, a path inside root"
    got = answer["value"]
    if got == want:
        return None
    if got is None:
        return (f"{want} has all {n} stages committed: when the newest step is not "
                f"complete, go back to the newest one that is")
    step = got.split("/")[0]
    if step != got or step not in (entries or {}):
        return (f"return the directory of the step, root / 'step_<t>' (not a stage's "
                f"directory, not root)")
    if entries[step] in ("file", "dir") or not STEP.fullmatch(step):
        return f"{step} is not a step directory: only step_<number> names count"
    stages = entries[step][:n].ljust(n, "-")
    missing = [stage(s) for s, c in enumerate(stages) if c == "-"]
    if missing:
        return (f"{step} has no directory {missing[0]}: that stage never saved this step. "
                f"A step counts only when every one of its {n} stages committed")
    if "u" in stages:
        return (f"{step}/{stage(stages.index('u'))} holds data but no {COMMITTED} marker: its "
                f"save died before the commit. A stage counts only when its directory holds "
                f"the marker (is_committed(path)), not because the directory exists")
    if step > want:  # complete, older by number, newer by name
        return (f"{want} is newer than {step}: compare the step numbers, int(...) of the "
                f"digits after step_, not the names ('{step}' > '{want}' as strings)")
    return f"{step} is complete, but {want} is newer and complete: return the newest"
