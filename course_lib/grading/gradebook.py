"""The gradebook: run a folder of submitted notebooks, one row per student.

    python -m course_lib.grading.gradebook submissions/ --out grades/gradebook.csv [--jobs 2]
    python -m course_lib.grading.gradebook submissions/ --slice 3/10 --out parts/part-3.csv
    python -m course_lib.grading.gradebook merge parts/*.csv --out grades/gradebook.csv

``submissions/<student>/<any>.ipynb`` or ``submissions/<student>.ipynb``; the lab
of each notebook is recognised from its content. Each notebook's code runs in a
sandbox of its own (:mod:`~course_lib.grading.sandbox`), its check cells put back
as the lab has them (hidden tests included) and decided by the judge
(:mod:`~course_lib.grading.judge`), a process that never runs student code:
the student's code runs on the checks' inputs, only plain data comes back, and
the judge computes the references and compares. By default only what the checks
need runs (setup, exercise cells, cells the student added); ``--full`` runs every
cell and keeps its outputs. Each notebook has ``--timeout`` seconds in all and
``--cell-timeout`` per cell. An exercise's result is one of pass, fail (the check
judged the code wrong, or it is a stub), error (the notebook stopped before it)
or timeout; it scores 1 when it passed.

Written as students are graded (a stop half-way leaves everyone graded so far):

- ``gradebook.csv``: student, a column per exercise (1/0), total, status, flags;
- ``gradebook.details.csv``: one row per exercise and notebook, with its result
  and the first line of its message;
- ``feedback/<student>.md`` and ``executed/<student>/<notebook>`` (the notebook as
  it ran), beside the CSV (``--files``); what the notebooks write goes to
  ``outputs/<student>/<notebook>/``, never into the submissions folder.

Every check also runs on settings drawn for each student and never shown (a
prediction on numbers it has not seen, a collective on sizes not in the notebook).
The draw comes from the class's secret: ``--secret-file`` (default
``<files>/hidden-settings.key``, made on first use; give every ``--slice`` the same
file) or ``COURSE_LIB_GRADING_SECRET``; ``--no-hidden`` grades the visible settings only.
"""
from __future__ import annotations

import argparse
import ast
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from course_lib.grading import integrity
from course_lib.grading.hidden import SECRET_FILE, class_secret
from course_lib.grading.book import DETAILS, FIXED, Book, Progress, exercise_key, merge  # noqa: F401
from course_lib.grading.judge import judge_notebook
from course_lib.grading.requests import SEAL_BROKEN
from course_lib.grading.submissions import (InvalidNotebook, find_submissions, load_labs,
                                            prepare, read_notebook, recognise)


# Seconds a lab's solution takes to grade, checks only, alone on 2 cores. Only the order
# of the work comes from it: longest first, so the last notebooks to start are short ones
# and no worker idles while another finishes a long lab.
TYPICAL_S = {"00": 6, "01": 9, "02": 23, "03": 15, "04": 12, "05": 12, "06": 14, "07": 11,
             "08": 28}


# ---- one notebook ----------------------------------------------------------------------------
@dataclass
class Graded:
    student: str
    name: str  # the notebook's path inside the student's submission
    lab: str | None = None
    status: str = "ok"  # ok, timeout, crashed, error, invalid notebook, wrong lab
    detail: str = ""
    results: dict = field(default_factory=dict)
    flags: list = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Settings:
    files: Path  # executed/, feedback/, outputs/ go here
    timeout: float = 900.0  # per notebook
    cell_timeout: float = 300.0
    params: dict = field(default_factory=dict)
    full: bool = False  # every cell, not only what the checks need
    sandboxed: bool | None = None  # None: the sandbox wherever it can start
    secret: str | None = None  # draws each student's hidden settings; None: none drawn


def grade_notebook(student, path, name, nb, lab, settings):
    """Grade one recognised notebook; returns a :class:`Graded` (never raises for what
    the notebook does)."""
    graded = Graded(student, name, lab.key)
    outputs = settings.files / "outputs" / student / Path(name).stem
    outputs.mkdir(parents=True, exist_ok=True)
    params = {"QUICK": True, **settings.params, "OUTPUT_DIR": str(outputs.resolve())}
    prepared, checks, graded.flags = prepare(nb, lab, params)
    student_cells = [(f"cell {i + 1}", c.source) for i, c in enumerate(prepared.cells)
                     if c.cell_type == "code" and c.get("id") not in checks
                     and "injected-parameters" not in c.metadata.get("tags", [])]
    graded.flags += integrity.scan(student_cells, lab.code_sources, lab.exercise_ids)
    judged = judge_notebook(prepared, lab, checks, outputs, full=settings.full,
                            timeout=settings.timeout, cell_timeout=settings.cell_timeout,
                            sandboxed=settings.sandboxed,
                            hidden=(settings.secret, student) if settings.secret else None)
    graded.status, graded.detail, graded.seconds = judged.status, judged.detail, judged.seconds
    if judged.status == "ok" and judged.timed_out:
        graded.detail = ", ".join(f"cell {i + 1}" for i in sorted(judged.timed_out)) + \
            f" stopped after {settings.cell_timeout:g} s (interrupted)"
    graded.results = judged.results
    if not judged.sandboxed:
        graded.flags.insert(0, "unsandboxed: the submission ran without the sandbox "
                               "(bwrap missing or not allowed here)")
    for exercise, (status, message) in graded.results.items():
        if status == "fail" and ("course_lib's own implementation" in message
                                 or SEAL_BROKEN in message):
            graded.flags.append(f"{exercise}: {message[:160]}")
    if judged.leftovers:
        graded.flags.append("processes left running were killed: " + ", ".join(judged.leftovers))
    executed = settings.files / "executed" / student / name
    executed.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(judged.nb, executed)
    return graded


def grade_file(student, path, name, labs, settings):
    """Read, recognise and grade one submitted file."""
    try:
        nb = read_notebook(path)
    except InvalidNotebook as exc:
        return Graded(student, name, status="invalid notebook", detail=str(exc))
    lab, why = recognise(nb, labs)
    if lab is None:
        return Graded(student, name, status="wrong lab",
                      detail=f"{why} (graded: {', '.join(labs)})")
    try:
        return grade_notebook(student, path, name, nb, lab, settings)
    except Exception as exc:  # noqa: BLE001 - a grader bug costs one row, not the class
        return Graded(student, name, lab.key, status="error",
                      detail=f"the grader failed: {type(exc).__name__}: {exc}"[:300])


# ---- the class -------------------------------------------------------------------------------
def _judges(jobs):
    """Where the notebooks are judged: one thread for ``jobs`` = 1, else ``jobs`` processes.

    Two judges never share an interpreter: CPython 3.11 keeps the AST constructor's
    recursion count per interpreter, so two threads parsing at once (a judge reading its
    cells, ``traceback`` placing a caret) can fail with "AST constructor recursion depth
    mismatch" (python/cpython gh-106905). Spawned, not forked: torch's OpenMP pool does
    not survive a fork of a process that used it."""
    if jobs <= 1:
        return ThreadPoolExecutor(max_workers=1)
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))


def _inside(path, folder):
    try:
        Path(path).resolve().relative_to(Path(folder).resolve())
        return True
    except ValueError:
        return False


def gradebook(folder, solutions="solutions", out="gradebook.csv", files=None, timeout=900.0,
              cell_timeout=300.0, jobs=1, part=(0, 1), only=None, params=None, full=False,
              sandboxed=None, secret_file=None, hidden=True):
    """Grade every submission in ``folder`` (those of slice ``part`` = (i, n)); returns
    (exercise columns, rows). Rows and feedback are written as students finish. With
    ``hidden``, each check also runs on settings drawn from the class's secret
    (:func:`class_secret` of ``secret_file``, default ``<files>/hidden-settings.key``)."""
    files = Path(files) if files is not None else Path(out).parent
    for path in (out, files, secret_file or files):
        if _inside(path, folder):
            raise ValueError(f"{path} is inside the submissions folder {folder}: grading "
                             f"writes nothing there")
    labs = load_labs(solutions)
    if only:
        unknown = [k for k in only if not any(key.startswith(k) for key in labs)]
        if unknown:
            raise ValueError(f"no lab {', '.join(unknown)} in {solutions}")
        labs = {key: lab for key, lab in labs.items() if any(key.startswith(k) for k in only)}
    submissions = find_submissions(folder)
    present, lab_of = set(), {}  # the whole class decides the columns: each slice the same
    for sub in submissions:
        for path in sub.notebooks:
            try:
                lab, _ = recognise(read_notebook(path), labs)
            except InvalidNotebook:
                continue
            present |= {lab.key} if lab else set()
            lab_of[path] = lab.key if lab else ""
    columns = sorted((ex for key in (present or labs) for ex in labs[key].exercise_ids),
                     key=exercise_key)
    index, count = part
    mine = submissions[index::count]
    book = Book(out, files, columns)
    secret = class_secret(secret_file or files / SECRET_FILE) if hidden else None
    settings = Settings(files, timeout, cell_timeout, dict(params or {}), full, sandboxed, secret)
    tasks = [(sub.student, path, str(path.relative_to(Path(folder) / sub.student))
              if path.parent != Path(folder) else path.name) for sub in mine for path in sub.notebooks]
    tasks.sort(key=lambda task: -TYPICAL_S.get(lab_of.get(task[1], "")[:2], 0))
    pending = {sub.student: len(sub.notebooks) for sub in mine}
    done = {sub.student: [] for sub in mine}
    for student in [s for s, n in pending.items() if n == 0]:
        book.add(student, [])
    progress = Progress(len(tasks))
    try:
        with _judges(jobs) as pool:
            futures = {pool.submit(grade_file, *task, labs, settings): task for task in tasks}
            try:
                for future in as_completed(futures):
                    try:
                        graded = future.result()
                    except Exception as exc:  # noqa: BLE001 - a judge process that died
                        student, path, name = futures[future]
                        graded = Graded(student, name, lab_of.get(path) or None, status="error",
                                        detail=f"the judge stopped: {type(exc).__name__}: "
                                               f"{exc}"[:300])
                    progress.update(graded)
                    done[graded.student].append(graded)
                    if len(done[graded.student]) == pending[graded.student]:
                        book.add(graded.student, sorted(done[graded.student], key=lambda g: g.name))
            except BaseException:  # an interrupt: the notebooks not started stay ungraded
                for future in futures:
                    future.cancel()
                raise
    finally:
        progress.close()
    return columns, book.rows


# ---- command line ------------------------------------------------------------------------------
def _slice(text):
    found = re.fullmatch(r"(\d+)/(\d+)", text)
    if not found or not int(found[1]) < int(found[2]):
        raise argparse.ArgumentTypeError(f"--slice takes i/n with 0 <= i < n, got {text!r}")
    return int(found[1]), int(found[2])


def _param(text):
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--param takes NAME=VALUE, got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        parser = argparse.ArgumentParser(prog="python -m course_lib.grading.gradebook merge")
        parser.add_argument("parts", nargs="+")
        parser.add_argument("--out", default="gradebook.csv")
        ns = parser.parse_args(argv[1:])
        try:
            columns, rows = merge(ns.parts, ns.out)
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {ns.out}: {len(rows)} student(s), {len(columns)} exercise(s)")
        return 0
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.gradebook",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submissions")
    parser.add_argument("--out", default="gradebook.csv", help="the gradebook CSV")
    parser.add_argument("--files", default=None,
                        help="executed notebooks, feedback and outputs (default: beside --out)")
    parser.add_argument("--solutions", default="solutions")
    parser.add_argument("--lab", action="append", default=None,
                        help="grade only this lab (e.g. 00); repeat for several")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per notebook")
    parser.add_argument("--cell-timeout", type=float, default=300, help="seconds per cell")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks graded at once")
    parser.add_argument("--slice", type=_slice, default=(0, 1), metavar="I/N",
                        help="grade only students I, I+N, I+2N, ... (0 <= I < N)")
    parser.add_argument("--param", type=_param, action="append", default=[], metavar="NAME=VALUE",
                        help="a parameter for every notebook (e.g. NPROC=2)")
    parser.add_argument("--full", action="store_true",
                        help="run every cell (demos, measurements, plots), not only what the "
                             "checks need, and keep all outputs in executed/")
    parser.add_argument("--secret-file", default=None,
                        help="the class's secret for the hidden settings (default: "
                             f"<files>/{SECRET_FILE}, made on first use)")
    parser.add_argument("--no-hidden", action="store_true",
                        help="grade only the settings the notebooks show")
    ns = parser.parse_args(argv)
    if not Path(ns.submissions).is_dir():
        print(f"error: no submissions folder {ns.submissions!r}", file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    if ns.jobs > max(1, cores // 2):
        print(f"note: --jobs {ns.jobs} on {cores} cores: each notebook is a kernel and a few "
              f"ranks, and checks that compete for cores take longer (about one per two "
              f"cores is the most that helps)", file=sys.stderr)
    started = time.monotonic()
    try:
        columns, rows = gradebook(ns.submissions, ns.solutions, ns.out, ns.files, ns.timeout,
                                  ns.cell_timeout, ns.jobs, ns.slice, ns.lab, dict(ns.param),
                                  ns.full, secret_file=ns.secret_file, hidden=not ns.no_hidden)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    seconds = time.monotonic() - started
    print(f"wrote {ns.out}: {len(rows)} student(s), {len(columns)} exercise(s) in {seconds:.0f} s"
          + (f" ({seconds / len(rows):.0f} s per student)" if rows else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
