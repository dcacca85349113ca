"""`make run`: papermill executes the solutions and collects their artifacts."""
import csv
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


LAB_LIKE = [  # what every lab does, in small: a job on NPROC ranks, a timeline, a trace
    "import os\nimport torch.distributed as dist\nfrom course_lib import run\n"
    "os.makedirs(OUTPUT_DIR, exist_ok=True)",
    "def work():\n    from course_lib import trace\n    with trace.span('compute', 'compute'):\n"
    "        return dist.get_rank()\n\n"
    "result = run(work, nproc=NPROC, backend=BACKEND)\nassert list(result) == list(range(NPROC))\n"
    "result.trace.plot().figure.savefig(os.path.join(OUTPUT_DIR, '98_timeline.png'))\n"
    "result.trace.to_chrome(os.path.join(OUTPUT_DIR, '98_trace.json'))",
]


def lab_like(folder):
    nb = new_notebook(cells=[new_code_cell("NPROC: int = 2\nBACKEND: str = 'auto'\n"
                                           "QUICK: bool = False\nOUTPUT_DIR: str = 'runs'")]
                      + [new_code_cell(src) for src in LAB_LIKE])
    nb.cells[0].metadata["tags"] = ["parameters"]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    folder.mkdir()
    nbformat.write(nb, folder / "98_small.ipynb")


@pytest.mark.slow
@pytest.mark.notebook
def test_papermill_runs_a_lab_with_parameters_and_leaves_timelines_and_traces(tmp_path):
    """The runner on a notebook shaped like a lab (nbval already runs the labs themselves
    once per suite): parameters injected, a real job, artifacts in the run folder."""
    lab_like(tmp_path / "solutions")
    out = tmp_path / "run"
    proc = runall("--solutions", str(tmp_path / "solutions"), "--quick", "--nproc", "3",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    executed = nbformat.read(out / "98_small.ipynb", as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert "NPROC = 3" in injected[0].source and "QUICK = True" in injected[0].source
    assert (out / "98_timeline.png").stat().st_size > 0
    trace = json.loads((out / "98_trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1, 2}
    assert "98_small.ipynb" in proc.stdout and "ok" in proc.stdout
    (row,) = list(csv.DictReader(open(out / "summary.csv")))
    assert row["notebook"] == "98_small.ipynb" and row["status"] == "ok"
    assert float(row["seconds"]) > 0


@pytest.mark.slow
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
    (row,) = list(csv.DictReader(open(tmp_path / "out" / "summary.csv")))
    assert row["status"] == "failed" and "broken on purpose" in row["error"]
