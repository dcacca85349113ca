"""Drive one notebook in JupyterLab as a student does: select cells, type into them, run
them (Shift+Enter, the Run menu, the toolbar), and wait for what the page shows.

Every wait is on a condition with a timeout. A wait that runs out raises AssertionError
naming the cell (its index and first line), what it waited for, and what the cell showed
instead (its prompt and the end of its output).
"""
import re
from pathlib import Path

# how IPython shows an exception the cell raised ("NcclRuleError    Traceback (most recent
# call last)"), not a traceback the cell printed on purpose (a rank's, inside a LaunchError
# that Lab 00 catches and prints: "Traceback (most recent call last):" on a line of its own)
RAISED = re.compile(r"\S[ \t]+Traceback \(most recent call last\)")

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "course-browser-test"
SHOTS = ROOT / "runs" / "browser"
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook on show
CELL = f"{PANEL} .jp-Notebook .jp-Cell"
CELLS = f"document.querySelectorAll('{CELL}')"
STATE = """([first, last]) => [...%s].slice(first, last + 1).map(c => ({
    prompt: c.querySelector('.jp-InputArea-prompt')?.textContent ?? '',
    code: c.classList.contains('jp-CodeCell'),
    text: c.querySelector('.jp-OutputArea')?.innerText ?? '',
    imgs: [...c.querySelectorAll('.jp-OutputArea-output img')].map(
        i => i.naturalWidth * i.naturalHeight),
    tables: c.querySelectorAll('.jp-OutputArea-output table').length}))""" % CELLS
# no code cell of [first, last] is queued or running, and one has run since `before` (a
# run queues them all at once; after an error JupyterLab drops the rest of the queue)
DONE = """([first, last, before]) => {
    const cells = [...%s].slice(first, last + 1);
    const prompts = cells.map(c => c.classList.contains('jp-CodeCell')
        ? c.querySelector('.jp-InputArea-prompt')?.textContent ?? '' : null);
    return !prompts.some(p => p !== null && p.includes('*'))
        && prompts.some((p, k) => p !== null && p !== before[k]);
}""" % CELLS


class Notebook:
    def __init__(self, page, cells, name):
        """``cells``: the notebook's [(cell_type, source)] as the file holds them."""
        self.page, self.cells, self.name = page, cells, name

    def describe(self, i):
        first = self.cells[i][1].strip().splitlines()[0][:70] if self.cells[i][1].strip() else ""
        return f"{self.name} cell {i} ({first!r})"

    def find(self, needle, start=0, code=True):
        """The index of the first (code) cell at or after ``start`` whose source holds
        ``needle``."""
        for i in range(start, len(self.cells)):
            if needle in self.cells[i][1] and (not code or self.cells[i][0] == "code"):
                return i
        raise AssertionError(f"{self.name}: no {'code ' if code else ''}cell holds {needle!r}")

    def state(self, first, last=None):
        return self.page.evaluate(STATE, [first, first if last is None else last])

    def _shown(self, i):
        s = self.state(i)[0]
        return f"prompt {s['prompt']!r}, output ending:\n{s['text'][-2500:] or '(no output)'}"

    def fail(self, i, waited_for, seconds):
        raise AssertionError(f"{self.describe(i)}: waited {seconds:g} s for {waited_for}; "
                             f"the cell shows {self._shown(i)}") from None

    def cell(self, i):
        return self.page.locator(CELL).nth(i)

    # ---- opening, selecting, running --------------------------------------------------
    def open(self, url, token):
        from playwright.sync_api import expect
        # a workspace of its own, reset: nothing a previous test opened comes back
        self.page.goto(f"{url}/lab/workspaces/{self.name.split('.')[0]}/tree/{self.name}"
                       f"?token={token}&reset")
        expect(self.page.locator(PANEL)).to_be_visible(timeout=60_000)
        # a run requested before the kernel is connected is dropped: wait for it
        expect(self.page.get_by_text("Python 3 (ipykernel) | Idle")).to_be_visible(
            timeout=120_000)
        expect(self.page.locator(CELL)).to_have_count(len(self.cells), timeout=30_000)

    def select(self, i):
        """Select cell ``i`` in command mode (a click on its prompt area)."""
        self.cell(i).locator(".jp-InputPrompt").first.click()
        self.page.keyboard.press("Escape")

    def prompts(self, first, last):
        return [s["prompt"] if s["code"] else None for s in self.state(first, last)]

    def wait_ran(self, first, last, before, seconds):
        """Wait until no code cell of [first, last] is queued or running; then every one
        must have run since ``before`` (their prompts then), none with a traceback."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout
        try:
            self.page.wait_for_function(DONE, arg=[first, last, before],
                                        timeout=seconds * 1000, polling=500)
        except PlaywrightTimeout:
            busy = [first + k for k, p in enumerate(self.prompts(first, last)) if p and "*" in p]
            self.fail(busy[0] if busy else first,
                      f"cells {first}-{last} to finish running", seconds)
        after = self.state(first, last)
        for k, s in enumerate(after):
            if s["code"] and (s["prompt"] == before[k] or RAISED.search(s["text"])
                              or not re.search(r"\[\d+\]", s["prompt"])):
                raise AssertionError(f"{self.describe(first + k)} did not run cleanly "
                                     f"(prompt before {before[k]!r}): {self._shown(first + k)}")

    def run_cells(self, first, last, seconds=300):
        """Shift+Enter on each cell of [first, last], as a student steps through them."""
        before = self.prompts(first, last)
        if all(p is None for p in before):
            return  # markdown only: already rendered
        self.select(first)
        for _ in range(first, last + 1):
            self.page.keyboard.press("Shift+Enter")
        self.wait_ran(first, last, before, seconds)

    def run_below(self, first, seconds):
        """Run > Run Selected Cell and All Below, from cell ``first``."""
        last = len(self.cells) - 1
        before = self.prompts(first, last)
        self.select(first)
        self.page.get_by_role("menuitem", name="Run", exact=True).click()
        self.page.get_by_text("Run Selected Cell and All Below", exact=True).click()
        self.wait_ran(first, last, before, seconds)

    def run_one(self, i, expect, seconds=180):
        """Run cell ``i`` (Shift+Enter) and wait for ``expect`` in its output; an error is
        expected output here (a check that fails shows its hint in a traceback)."""
        before = self.prompts(i, i)
        self.select(i)
        self.page.keyboard.press("Shift+Enter")
        self.wait_text(i, expect, seconds, before=before[0])

    def wait_text(self, i, expect, seconds, before=None):
        """Wait until cell ``i`` has run (its prompt is a new number) and its output holds
        ``expect``."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout
        try:
            self.page.wait_for_function(
                """([i, expect, before]) => {
                    const c = %s[i];
                    const p = c.querySelector('.jp-InputArea-prompt')?.textContent ?? '';
                    return /\\[\\d+\\]/.test(p) && p !== before
                        && (c.querySelector('.jp-OutputArea')?.innerText ?? '').includes(expect);
                }""" % CELLS, arg=[i, expect, before], timeout=seconds * 1000, polling=500)
        except PlaywrightTimeout:
            self.fail(i, f"{expect!r} in its output", seconds)

    # ---- typing -------------------------------------------------------------------------
    def type_into(self, i, text, pasted=False):
        """Replace cell ``i``'s source by typing ``text`` into its editor, key by key. The
        editor indents a new line itself: each line's indentation is selected (Shift+Home)
        and deleted before the line, with its own indentation, is typed. ``pasted``: each
        line goes in as one input event, as a pasted line does (a key costs a round trip
        to the browser: a long solution typed key by key took 20 s); the line breaks and
        the deletions are still keys."""
        editor = self.cell(i).locator(".cm-content")
        editor.click()
        keys = self.page.keyboard
        keys.press("Control+a")
        keys.press("Delete")
        for n, line in enumerate(text.splitlines()):
            if n:
                keys.press("Enter")
                keys.press("Shift+Home")
                keys.press("Delete")
            keys.insert_text(line) if pasted else keys.type(line)
        typed = self.cell(i).evaluate(
            "c => [...c.querySelectorAll('.cm-line')].map(l => l.textContent).join('\\n')")
        keys.press("Escape")
        if typed.rstrip() != text.rstrip():
            raise AssertionError(f"{self.describe(i)}: typed\n{text}\nbut the editor holds\n"
                                 f"{typed}")

    # ---- widgets ------------------------------------------------------------------------
    def widget_output(self, i):
        """What the interact of cell ``i`` shows: its output's text and pictures."""
        return self.cell(i).locator(".widget-interact").first.evaluate(
            """w => { const o = w.querySelector('.widget-output') ?? w;
                      return [o.innerText, [...o.querySelectorAll('img')].map(
                          i => i.naturalWidth > 0 ? i.src : 'empty')]; }""")

    def move(self, i, label, action, value):
        """Move the control ``label`` of cell ``i``'s interact: drag a slider's handle to
        ``value`` (a fraction of its track), pick ``value`` in a dropdown, click a checkbox.
        Returns the control's value as it reads after."""
        box = self.cell(i).locator(".widget-interact").first
        if action == "check":  # a checkbox's description is beside it, not a label before
            control = box.locator(".widget-checkbox").filter(has_text=label).first
        else:
            control = box.locator(".widget-inline-hbox").filter(
                has=self.page.locator(f"label.widget-label:text-is('{label}')")).first
        if not control.count():
            raise AssertionError(f"{self.describe(i)}: no control {label!r} in its widget; it "
                                 f"shows {box.inner_text()[:1000]!r}")
        control.scroll_into_view_if_needed()
        if action == "drag":
            handle, track = control.locator(".noUi-handle"), control.locator(".noUi-target")
            readout = control.locator(".widget-readout")
            was = readout.inner_text()
            h, t = handle.bounding_box(), track.bounding_box()
            y = h["y"] + h["height"] / 2
            self.page.mouse.move(h["x"] + h["width"] / 2, y)
            self.page.mouse.down()
            self.page.mouse.move(t["x"] + value * t["width"], y, steps=8)
            self.page.mouse.up()
            try:
                self.page.wait_for_function("([r, was]) => r.textContent.trim() !== was",
                                            arg=[readout.element_handle(), was], timeout=10_000)
            except Exception:
                raise AssertionError(f"{self.describe(i)}: dragged the handle of {label!r} to "
                                     f"{value:.0%} of its track; it still reads {was!r}") from None
            return readout.inner_text()
        if action == "select":
            control.locator("select").select_option(label=value)
            return value
        control.locator("input[type=checkbox]").click()
        return str(control.locator("input[type=checkbox]").is_checked())
