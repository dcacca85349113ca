"""One JupyterLab server and one headless Chromium for every browser test of a session.

`make test-browser` installs what this needs (Playwright for Python; Debian's chromium
when it is missing and the user is root) and runs the tests; `make test` leaves them out
(marker ``browser``). The server runs on localhost with a fixed token on a free port,
with ``MPLBACKEND=Agg`` exported (as on many clusters: the kernels inherit it, and the
labs must still show their figures), on a folder of its own that each test copies its
notebook into. At the end the server is stopped, its kernels (and their torchrun jobs)
with it.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from browser.notebook import SHOTS, TOKEN

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(folder):
    """Render every cell (JupyterLab 4 otherwise renders only those near the viewport);
    no brackets closed behind the typist, so that what is typed is what the cell holds."""
    for plugin, values in {"notebook-extension/tracker": {"windowingMode": "none"},
                           "codemirror-extension/plugin": {
                               "defaultConfig": {"autoClosingBrackets": False}},
                           # no "get notified about Jupyter news?" box over the page
                           "apputils-extension/notification": {"fetchNews": "false"}}.items():
        path = folder / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@pytest.fixture(scope="session")
def jupyter_lab(tmp_path_factory):
    """(url, folder): a JupyterLab server serving ``folder``; stopped, kernels and all, after."""
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH: `make test-browser` installs Debian's chromium "
                    "when run as root; otherwise `apt-get install chromium` first")
    pytest.importorskip("playwright", reason="`make test-browser` installs playwright")
    home = tmp_path_factory.mktemp("jupyterlab")
    folder = home / "notebooks"
    folder.mkdir()
    _settings(home / "settings")
    port = _free_port()
    log_path = home / "jupyter.log"
    log = open(log_path, "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}",
         "--ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={folder}",
         "--ServerApp.open_browser=False", "--LabApp.news_url=None",
         "--ServerApp.allow_root=True",  # CI runs as root
         f"--LabApp.user_settings_dir={home / 'settings'}",
         f"--LabApp.workspaces_dir={home / 'workspaces'}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=folder, start_new_session=True,
        env={**{k: v for k, v in os.environ.items() if k != "COURSE_LIB_WARM_MAX"},
             "MPLBACKEND": "Agg",
             # every lab's jobs keep NCCL's rules: a lab that would hang or break on a GPU
             # cluster fails here (make test-nccl-rules leaves the notebooks to this run)
             "COURSE_LIB_NCCL_RULES": "1"})
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
                pytest.fail("jupyter lab did not start within 90 s:\n" + log_path.read_text())
            time.sleep(0.5)
    try:
        yield url, folder
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


@pytest.fixture(scope="session")
def chromium(jupyter_lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # the flags keep Chromium off the network, which CI does not reach
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            yield browser
        finally:
            browser.close()


def shutdown_kernels(url):
    """Shut down every kernel of the server (each ends its torchrun jobs as it exits)."""
    def call(method, path):
        request = urllib.request.Request(f"{url}{path}?token={TOKEN}", method=method)
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read() or b"null")
    for kernel in call("GET", "/api/kernels"):
        call("DELETE", f"/api/kernels/{kernel['id']}")


@pytest.fixture
def page(chromium, jupyter_lab):
    """A fresh page; after the test, the server's kernels are shut down."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    context = chromium.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    try:
        yield page
    finally:
        context.close()
        shutdown_kernels(jupyter_lab[0])
