"""`make run`: papermill executes the solutions and collects their artifacts."""
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

ROOT = Path(__file__).resolve().parents[2]


def runall(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "course_lib.grading.runall", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=1200)


@pytest.mark.notebook
def test_lab00_runs_under_papermill_and_leaves_timelines_and_traces(tmp_path):
    out = tmp_path / "run"
    proc = runall("--quick", "--only", "00", "--nproc", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    executed = nbformat.read(out / "00_launch.ipynb", as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert "NPROC = 3" in injected[0].source and "QUICK = True" in injected[0].source
    assert (out / "00_timeline.png").stat().st_size > 0
    assert (out / "00_ping_pong.png").stat().st_size > 0
    trace = json.loads((out / "00_trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1, 2}
    assert "00_launch.ipynb" in proc.stdout and "ok" in proc.stdout


def test_a_failing_notebook_fails_the_run(tmp_path):
    nb = new_notebook(cells=[new_code_cell("QUICK = False\nNPROC = 2\nBACKEND = 'auto'\n"
                                           "OUTPUT_DIR = '.'"),
                             new_code_cell("raise RuntimeError('broken on purpose')")])
    nb.cells[0].metadata["tags"] = ["parameters"]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    (tmp_path / "solutions").mkdir()
    nbformat.write(nb, tmp_path / "solutions" / "99_broken.ipynb")
    proc = runall("--solutions", str(tmp_path / "solutions"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "FAILED" in proc.stdout and "broken on purpose" in proc.stdout
