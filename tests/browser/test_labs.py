"""Every lab in a real JupyterLab, in headless Chromium, worked the way a student works it.

Each test opens a copy of the student lab (labs/NN_*.ipynb) whose exercises the test has
filled from the solutions, except one exercise and one prediction (tests/browser/labs.py
says which). It runs the cells above them; types a wrong answer into each through the
editor, key by key, runs it and its check and finds the check's hint for that mistake;
enters the solution through the editor (line by line, each line one input event as a
pasted line is, its line breaks keys), runs again and finds the pass line. Then it runs
the rest of the notebook and finds, rendered, every picture (a cell that saves a figure
shows it too), the tables, the output by rank, and moves every ipywidgets control, whose
output must change. A screenshot of each lab lands in runs/browser/. The server runs
with MPLBACKEND=Agg.
"""
import json
import time

import pytest

from browser.labs import LABS
from browser.notebook import ROOT, SHOTS, TOKEN, Notebook

pytestmark = pytest.mark.browser
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
REST_S = 600  # the rest of one lab, quick setting, on a busy 2-core machine


def solution_source(source):
    return "\n".join(line for line in source.splitlines() if line.strip() not in (BEGIN, END))


def stub_line(source, item):
    for line in source.splitlines():
        if line.strip().startswith(f"raise NotImplementedError('{item}:"):
            return line
    raise AssertionError(f"no stub raising NotImplementedError('{item}...') in {source!r}")


def prepare(lab, folder, keep):
    """Copy labs/<lab>.ipynb into ``folder`` with every solution region filled in from
    solutions/, except in the code cells of the items ``keep`` (left as stubs). Returns
    (file name, [(cell_type, source)], {item: (stub cell, solution source)})."""
    student = json.loads((ROOT / "labs" / f"{lab}.ipynb").read_text())
    solved = json.loads((ROOT / "solutions" / f"{lab}.ipynb").read_text())
    kept = {}
    for mine, theirs in zip(student["cells"], solved["cells"]):
        source, answer = "".join(mine["source"]), "".join(theirs["source"])
        if BEGIN not in answer:
            continue
        item = next((k for k in keep if mine["cell_type"] == "code"
                     and f"raise NotImplementedError('{k}:" in source), None)
        if item is None:
            mine["source"] = solution_source(answer)
        else:
            kept[item] = (source, solution_source(answer))
    assert set(kept) == set(keep), f"{lab}: no stub cell for {set(keep) - set(kept)}"
    name = f"{lab}.ipynb"
    (folder / name).write_text(json.dumps(student, indent=1))
    return name, [(c["cell_type"], "".join(c["source"])) for c in student["cells"]], kept


class Phases:
    """Seconds per phase of a test, printed for whoever runs it (``-s``)."""

    def __init__(self):
        self.seconds, self.mark = {}, time.monotonic()

    def lap(self, phase):
        now = time.monotonic()
        self.seconds[phase] = self.seconds.get(phase, 0) + now - self.mark
        self.mark = now

    def __str__(self):
        return ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items())


def work_an_item(nb, typed, stub, answer, phases):
    """Type a wrong answer into ``typed.item``'s cell, run it and its check, find the hint;
    enter the solution (line by line, as pasted lines), run both again, find the pass
    line."""
    cell = nb.find(f"raise NotImplementedError('{typed.item}:")
    check = cell + 1
    assert nb.cells[check][0] == "code", f"{nb.describe(check)} is not {typed.item}'s check"
    line = stub_line(stub, typed.item)
    indent = line[: len(line) - len(line.lstrip())]
    wrong = "\n".join(indent + w for w in typed.wrong.splitlines())
    phases.lap("other")
    nb.type_into(cell, stub.replace(line, wrong))
    phases.lap("typing")
    nb.run_cells(cell, cell)
    nb.run_one(check, typed.hint)
    phases.lap("checks")
    nb.type_into(cell, answer, pasted=True)  # the wrong answer was typed key by key
    phases.lap("typing")
    nb.run_cells(cell, cell)
    nb.run_one(check, f"✓ {typed.item} passed")
    phases.lap("checks")
    return check


def move_widgets(nb, lab):
    """Move each control; once the kernel is idle again, the interact's output must have
    changed: its text, and its picture where it shows one (a new one, of non-zero size)."""
    idle = nb.page.get_by_text("Python 3 (ipykernel) | Idle")
    for snippet, steps in lab.widgets.items():
        i = nb.find(snippet)
        for label, action, value, expect, redraws in steps:
            before = nb.widget_output(i)
            now = nb.move(i, label, action, value)
            want = expect.format(value=now) if expect else None
            deadline = time.monotonic() + 60
            while True:  # the kernel redraws: poll for the new output, 60 s at most
                after = nb.widget_output(i)
                if (idle.is_visible() and after != before and "empty" not in after[1]
                        and (after[1] and after[1] != before[1] if redraws
                             else len(after[1]) == len(before[1]))
                        and (want is None or want in after[0])):
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{nb.describe(i)}: moved {label!r} ({action} {value!r}, reads {now!r}) "
                        f"and waited 60 s for the kernel to be idle and the widget's text"
                        + (" and its picture" if redraws else "") + " to change"
                        + (f" and show {want!r}" if want else "")
                        + f"; it shows {after[0][-1500:]!r} and pictures "
                        f"{[s[-40:] for s in after[1]]} (before: {before[0][-500:]!r}, "
                        f"{[s[-40:] for s in before[1]]})")
                nb.page.wait_for_timeout(250)


def check_rendered(nb, lab):
    """Every picture has a size; a cell that saves a figure shows one; enough pictures and
    tables; the lab's own text (output by rank, the magic's output) is on the page."""
    cells = nb.state(0, len(nb.cells) - 1)
    images = sum(len(s["imgs"]) for s in cells)
    tables = sum(s["tables"] for s in cells)
    for i, s in enumerate(cells):
        assert all(s["imgs"]), f"{nb.describe(i)} shows a picture of zero size"
        source = nb.cells[i][1]  # a figure saved and closed is for the run's folder only
        if "savefig(" in source and "plt.close(" not in source and not s["imgs"]:
            raise AssertionError(f"{nb.describe(i)} saves a figure but shows none: "
                                 f"{s['text'][-1500:]!r}")
    assert images >= lab.images, f"{lab.name}: {images} pictures shown, expected {lab.images}+"
    assert tables >= lab.tables, f"{lab.name}: {tables} tables shown, expected {lab.tables}+"
    text = "\n".join(s["text"] for s in cells)
    for wanted in lab.shows:
        assert wanted in text, f"{lab.name}: {wanted!r} is nowhere in the outputs"
    return images, tables


@pytest.mark.parametrize("lab", LABS, ids=[lab.name[:2] for lab in LABS])
def test_lab_worked_in_jupyterlab(lab, jupyter_lab, page):
    url, folder = jupyter_lab
    phases = Phases()
    typed = [lab.exercise, lab.prediction]
    name, cells, kept = prepare(lab.name, folder, [t.item for t in typed])
    nb = Notebook(page, cells, name)
    nb.open(url, TOKEN)
    phases.lap("open")
    try:
        order = sorted(typed, key=lambda t: nb.find(f"raise NotImplementedError('{t.item}:"))
        done = 0
        for t in order:
            cell = nb.find(f"raise NotImplementedError('{t.item}:")
            if cell > done:
                nb.run_cells(done, cell - 1, seconds=REST_S)
                phases.lap("cells")
            done = work_an_item(nb, t, *kept[t.item], phases) + 1
        nb.run_below(done, seconds=REST_S)
        phases.lap("cells")
        images, tables = check_rendered(nb, lab)
        move_widgets(nb, lab)
        phases.lap("widgets")
    finally:
        page.screenshot(path=str(SHOTS / f"lab{lab.name[:2]}.png"), full_page=True)
    print(f"\n{lab.name}: {images} pictures, {tables} tables; {phases}")
