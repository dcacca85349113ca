"""Lab 00, solved, run in a real JupyterLab by a real (headless) Chromium.

`make test-browser` installs what this needs (Playwright for Python; Debian's chromium
when it is missing and the user is root) and runs it; `make test` leaves it out (marker
``browser``). It starts `jupyter lab` on localhost with a fixed token on a free port,
opens a solved copy of labs/00 (the solution notebook), runs every cell from the Run
menu, and looks in the page for what a student would see: output prefixed by rank,
a check's pass line, a timeline picture, and the `%%torchrun` magic's output. The
server runs with MPLBACKEND=Agg exported, as on many clusters. A screenshot lands in
runs/browser/.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TOKEN = "course-browser-test"
LAB = "00_launch.ipynb"
pytestmark = pytest.mark.browser


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyter_lab(tmp_path):
    """A JupyterLab server on a solved copy of Lab 00; stopped, kernels and all, after."""
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH: `make test-browser` installs Debian's chromium "
                    "when run as root; otherwise `apt-get install chromium` first")
    pytest.importorskip("playwright", reason="`make test-browser` installs playwright")
    shutil.copy(ROOT / "solutions" / LAB, tmp_path / LAB)
    # render every cell (JupyterLab 4 otherwise renders only those near the viewport)
    settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    port = _free_port()
    log = open(tmp_path / "jupyter.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}",
         "--ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={tmp_path}",
         "--ServerApp.open_browser=False", "--LabApp.news_url=None",
         "--ServerApp.allow_root=True",  # CI runs as root
         f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
        # as many clusters export it: the kernel inherits it, and the lab must still show
        # its figures (its %matplotlib inline)
        env={**os.environ, "MPLBACKEND": "Agg"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2) as reply:
                json.load(reply)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail("jupyter lab did not start:\n" + (tmp_path / "jupyter.log").read_text())
            time.sleep(0.5)
    try:
        yield url
    finally:
        server.send_signal(signal.SIGINT)  # jupyter asks to confirm: a second one shuts down
        time.sleep(0.5)
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def test_lab00_runs_in_jupyterlab_in_a_browser(jupyter_lab):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect, sync_playwright

    shots = ROOT / "runs" / "browser"
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        # the flags keep Chromium off the network, which this machine does not reach
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{jupyter_lab}/lab/tree/{LAB}?token={TOKEN}")
            notebook = page.locator(".jp-NotebookPanel")
            expect(notebook).to_be_visible(timeout=60_000)
            # a run requested before the kernel is connected is dropped: wait for it
            expect(page.get_by_text("Python 3 (ipykernel) | Idle")).to_be_visible(timeout=120_000)
            started = """() => [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
                .some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))"""
            for attempt in (1, 2):
                page.get_by_role("menuitem", name="Run", exact=True).click()
                page.get_by_text("Run All Cells", exact=True).click()
                try:  # queued cells show [*]: at once, unless the kernel dropped the request
                    page.wait_for_function(started, timeout=30_000, polling=500)
                    break
                except PlaywrightTimeout:
                    if attempt == 2:
                        status = page.locator(".jp-StatusBar-Widget").all_inner_texts()
                        raise AssertionError(f"Run All Cells queued no cell, twice; status bar: "
                                             f"{status}") from None
            # Run All has finished when no prompt says [*]: (running or queued) and one has a
            # number; a cell that raised leaves the cells after it at [ ]: at once
            try:
                page.wait_for_function(
                    """() => {
                        const prompts = [...document.querySelectorAll(
                            '.jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent);
                        return prompts.some(p => /\\[\\d+\\]/.test(p))
                            && !prompts.some(p => p.includes('*'));
                    }""", timeout=480_000, polling=1000)
            finally:
                page.screenshot(path=str(shots / "lab00.png"), full_page=True)
            cells = page.evaluate("""() => [...document.querySelectorAll('.jp-CodeCell')].map(c => [
                c.querySelector('.jp-InputArea-prompt')?.textContent ?? '?',
                (c.querySelector('.jp-InputArea-editor')?.textContent ?? '').slice(0, 60)])""")
            not_run = [f"{prompt} {source!r}" for prompt, source in cells
                       if not re.search(r"\[\d+\]", prompt)]
            text = notebook.inner_text()
            assert not not_run, ("cells Run All did not run:\n" + "\n".join(not_run) + "\n\n"
                                 + (text[max(0, text.index("Traceback") - 500):][:3000]
                                    if "Traceback" in text else "(no traceback on the page)"))
            assert "[rank0]" in text and "[rank1]" in text  # live output, prefixed by rank
            assert "✓ Exercise 0.1 passed" in text
            assert "I am rank 1 of" in text  # the %%torchrun cell ran on every rank
            assert "Traceback" not in text, text[max(0, text.index("Traceback") - 500):][:2000]
            images = page.locator(".jp-OutputArea-output img")
            assert images.count() >= 2  # the ping-pong plot and the timeline
            assert images.last.evaluate("img => img.naturalWidth") > 100
            images.last.screenshot(path=str(shots / "lab00_timeline.png"))
        finally:
            browser.close()
