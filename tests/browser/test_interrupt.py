"""A job that deadlocks, interrupted from the toolbar (once in the course: Lab 00).

A student whose ranks hang does not wait for the timeout: they press the toolbar's stop
button. The cell must then show where every rank was (the job's diagnosis, as a timeout
shows it), and the notebook must go on: the next cell's job runs.
"""
import pytest

from browser.notebook import CELLS, SHOTS, TOKEN, Notebook
from browser.test_labs import prepare

pytestmark = pytest.mark.browser
DEADLOCK = '''def everyone_sends():
    rank, world = dist.get_rank(), dist.get_world_size()
    print("sending to my right neighbour", flush=True)
    comm.send(torch.ones(1000), (rank + 1) % world)  # nobody receives


run(everyone_sends, nproc=2, backend=PAIR, timeout=600)'''


def test_an_interrupted_deadlock_shows_the_ranks_stacks_and_the_next_cell_runs(
        jupyter_lab, page):
    url, folder = jupyter_lab
    name, cells, _ = prepare("00_launch", folder, [])
    nb = Notebook(page, cells, name)
    nb.open(url, TOKEN)
    try:
        setup = nb.find("%load_ext course_lib")
        nb.run_cells(0, setup)
        nb.select(setup)
        page.keyboard.press("b")  # a new cell below the setup, as a student adds one
        cell = setup + 1
        nb.cells.insert(cell, ("code", DEADLOCK))
        nb.type_into(cell, DEADLOCK)
        before = nb.prompts(cell, cell)[0]
        nb.select(cell)
        page.keyboard.press("Shift+Enter")
        # both ranks are inside send once both have printed
        nb.page.wait_for_function(
            """i => { const t = %s[i].querySelector('.jp-OutputArea')?.innerText ?? '';
                      return t.includes('[rank0] sending') && t.includes('[rank1] sending'); }"""
            % CELLS,
            arg=cell, timeout=120_000, polling=500)
        page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-NotebookPanel-toolbar "
                     "[data-command='notebook:interrupt-kernel']").click()
        # the diagnosis a timeout gives: each rank's stack, from the student's function
        for wanted in ("Where each rank was", "--- rank 0 ---", "--- rank 1 ---",
                       "everyone_sends"):
            nb.wait_text(cell, wanted, 30, before=before)
        nb.cell(cell).screenshot(path=str(SHOTS / "lab00_interrupted_cell.png"))
        rows = nb.find("for row in info:")
        nb.run_cells(rows - 1, rows)  # the next job: whoami on every rank, then its rows
        nb.wait_text(rows, "RANK=1", 30, before=None)
    finally:
        page.screenshot(path=str(SHOTS / "lab00_interrupt.png"), full_page=True)
