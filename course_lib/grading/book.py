"""The gradebook's files, written as students are graded, and merging slices of a class.

``gradebook.csv`` has a row per student (a column per exercise, 1 or 0, the
total, a status and flags, one flag a line in its cell), ``gradebook.details.csv`` a row per exercise and
notebook (its result and the first line of its message), and
``feedback/<student>.md`` a page per student. Each row is appended, and the
file flushed, as soon as that student's notebooks are all graded, so a grader
stopped half-way leaves valid files for everyone graded so far.
"""
from __future__ import annotations

import csv
import sys
import threading
from pathlib import Path

from course_lib.grading import feedback, ids

FIXED = ["student", "total", "status", "flags"]
DETAILS = ["student", "notebook", "lab", "exercise", "status", "message", "seconds"]


exercise_key = ids.sort_key


class Book:
    """The gradebook files, appended to as students are graded (thread-safe)."""

    def __init__(self, out, files, columns):
        self.out, self.files, self.columns = Path(out), Path(files), list(columns)
        self.details = self.out.with_name(self.out.stem + ".details.csv")
        self.lock, self.rows = threading.Lock(), []
        self.out.parent.mkdir(parents=True, exist_ok=True)
        for path, fields in ((self.out, self.fields), (self.details, DETAILS)):
            with open(path, "w", newline="") as f:
                csv.DictWriter(f, fieldnames=fields).writeheader()

    @property
    def fields(self):
        return ["student", *self.columns, "total", "status", "flags"]

    def add(self, student, graded):
        """One student's row, from the results of all their notebooks."""
        scores = {ex: 0 for ex in self.columns}
        for g in graded:
            for ex, (status, _) in g.results.items():
                if ex in scores and status == "pass":
                    scores[ex] = 1
        statuses = [f"{g.name}: {g.status}" + (f" ({g.detail})" if g.detail else "")
                    for g in graded if g.status != "ok" or g.detail]
        labs = [g.lab for g in graded if g.lab]
        flags = [f"{g.name}: {' '.join(str(flag).split())}" for g in graded for flag in g.flags]
        flags += [f"several notebooks are lab {lab}; the best result of each exercise counts"
                  for lab in sorted(set(labs)) if labs.count(lab) > 1]
        row = {"student": student, **scores, "total": sum(scores.values()),
               "status": "; ".join(statuses) if statuses else ("ok" if graded else "no notebook"),
               "flags": "\n".join(flags)}  # one flag a line: a flag may hold any punctuation
        page = feedback.render(student, [(g.name, g.lab, g.status, g.detail, g.seconds, g.results)
                                         for g in graded], self.columns, row["total"], flags)
        with self.lock:
            with open(self.out, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.fields).writerow(row)
            with open(self.details, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=DETAILS)
                for g in graded:
                    for ex, (status, message) in (g.results or {"": (g.status, g.detail)}).items():
                        writer.writerow({"student": student, "notebook": g.name, "lab": g.lab or "",
                                         "exercise": ex, "status": status, "message": message,
                                         "seconds": f"{g.seconds:.1f}"})
            (self.files / "feedback").mkdir(parents=True, exist_ok=True)
            (self.files / "feedback" / f"{student}.md").write_text(page)
            self.rows.append(row)
        return row


class Progress:
    def __init__(self, total):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.bar = tqdm(total=total, unit="notebook", desc="grading", file=sys.stderr) \
            if tqdm else None
        self.done, self.total = 0, total

    def update(self, graded):
        self.done += 1
        text = f"{graded.student}/{graded.name}: {graded.status} ({graded.seconds:.0f} s)"
        if self.bar is not None:
            self.bar.set_postfix_str(text[:60])
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def merge(parts, out):
    """One gradebook (and details file) from the slices' CSVs; a student in two slices is
    an error."""
    parts = [Path(p) for p in parts if not str(p).endswith(".details.csv")]
    rows, columns, seen = [], set(), {}
    for part in parts:
        with open(part, newline="") as f:
            reader = csv.DictReader(f)
            columns |= {c for c in reader.fieldnames or [] if c not in FIXED}
            for row in reader:
                if row["student"] in seen:
                    raise ValueError(f"student {row['student']!r} is in {seen[row['student']]} "
                                     f"and in {part}")
                seen[row["student"]] = part
                rows.append(row)
    columns = sorted(columns, key=exercise_key)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["student", *columns, "total", "status", "flags"])
        writer.writeheader()
        for row in sorted(rows, key=lambda r: r["student"]):
            writer.writerow({**{c: row.get(c) or "0" for c in columns}, **{k: row[k] for k in FIXED}})
    details = [p.with_name(p.stem + ".details.csv") for p in parts]
    with open(out.with_name(out.stem + ".details.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=DETAILS)
        writer.writeheader()
        for path in details:
            if path.exists():
                with open(path, newline="") as part:
                    writer.writerows(csv.DictReader(part))
    return columns, rows
