"""`runall --parallel`: each notebook in a process of its own, side by side (what make
gpu-check does with every lab), a hung one stopped at its wall timeout."""
import csv
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

ROOT = Path(__file__).resolve().parents[2]


def notebook(folder, name, code):
    nb = new_notebook(cells=[new_code_cell("QUICK = False\nNPROC = 2\nBACKEND = 'auto'\n"
                                           "OUTPUT_DIR = '.'"), new_code_cell(code)])
    nb.cells[0].metadata["tags"] = ["parameters"]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, folder / name)


@pytest.mark.slow  # three kernels and a 30 s wall timeout: `make test-slow` (CI runs it)
def test_notebooks_side_by_side_each_in_its_own_process(tmp_path):
    sols, out = tmp_path / "solutions", tmp_path / "out"
    sols.mkdir()
    notebook(sols, "01_fine.ipynb", "assert NPROC == 1, NPROC  # the parameter went through")
    notebook(sols, "02_broken.ipynb", "raise RuntimeError('broken on purpose')")
    notebook(sols, "03_hung.ipynb", "import time\ntime.sleep(600)")
    proc = subprocess.run([sys.executable, "-m", "course_lib.grading.runall", "--solutions",
                           str(sols), "--out", str(out), "--nproc", "1", "--parallel", "3",
                           "--notebook-timeout", "30"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["notebook"]: r for r in csv.DictReader(open(out / "summary.csv"))}
    assert list(rows) == ["01_fine.ipynb", "02_broken.ipynb", "03_hung.ipynb"]
    assert rows["01_fine.ipynb"]["status"] == "ok"
    assert "broken on purpose" in rows["02_broken.ipynb"]["error"]
    assert rows["03_hung.ipynb"]["error"].startswith("Timeout: stopped after")
    assert float(rows["03_hung.ipynb"]["seconds"]) >= 29  # stopped at its timeout, not before
    # each notebook's output went to its own log, beside the executed notebooks
    assert "broken on purpose" in (out / "logs" / "02_broken.log").read_text()
    assert (out / "01_fine.ipynb").is_file() and (out / "logs" / "01_fine.result.json").is_file()
