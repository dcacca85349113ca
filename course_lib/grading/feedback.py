"""One markdown page per student: each exercise's result and what to look at."""
from __future__ import annotations

STATUS_WORDS = {"pass": "passed", "fail": "failed", "error": "error", "timeout": "timed out"}


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(student, notebooks, columns, total, flags):
    """``notebooks``: [(name, lab key or None, status, detail, seconds, {exercise: (status,
    message)})]; ``columns``: the gradebook's exercises."""
    lines = [f"# Feedback for {student}", "",
             f"**Score: {total} of {len(columns)}** (one point per exercise whose check "
             f"passed)", ""]
    if not notebooks:
        lines += ["No notebook was found in your submission.", ""]
    for name, lab, status, detail, seconds, results in notebooks:
        lines.append(f"## {name}" + (f" (lab {lab})" if lab else ""))
        lines.append("")
        if status != "ok":
            lines += [f"**{status}**" + (f": {detail}" if detail else ""), ""]
        if results:
            lines += ["| exercise | result | message |", "|---|---|---|"]
            for exercise, (result, message) in results.items():
                lines.append(f"| {exercise} | {STATUS_WORDS.get(result, result)} | "
                             f"{_cell(message)} |")
            lines.append("")
        if seconds:
            lines += [f"_Graded in {seconds:.0f} s._", ""]
    if flags:
        lines += ["## Noted by the grader", "",
                  "Your instructor will read these parts of your notebook:", ""]
        lines += [f"- {_cell(flag)}" for flag in flags]
        lines.append("")
    return "\n".join(lines)
