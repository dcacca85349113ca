"""The committed reference figures (reference/h100/summary.json, make gpu-check on one
H100 on 2026-11-28, unattended, one run) load from the checkout, carry every lab, and
read beside a student's own."""
import json
import re
from pathlib import Path

import pytest

from course_lib.bench import gpucheck, reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_h100_summary_loads_with_every_lab_and_the_runs_figures():
    ref = reference.load("h100")
    assert reference.path("h100") == ROOT / "reference" / "h100"
    assert set(gpucheck.SUMMARY_KEYS) <= set(ref)
    assert set(gpucheck.MACHINE_KEYS) <= set(ref["machine"])
    assert ref["date"] == "2026-11-28" and ref["machine"]["gpu"] == "NVIDIA H100 80GB HBM3"
    assert ref["machine"]["torch"] == "2.11.0+cu130" and ref["machine"]["nccl"] == "2.28.9"
    assert ref["commit"] == "c80f7f8" and ref["source"] == "python -m course_lib.bench.gpucheck"
    assert sorted(ref["labs"]) == [f"{n:02d}" for n in range(9)] == sorted(ref["notebooks"])
    for lab, entry in ref["labs"].items():
        assert entry["notebook"].startswith(lab + "_") and entry["status"] in ("ok", "failed")
        assert entry["seconds"] > 0 and set(entry["figures"]) <= set(reference.FIGURES)
        assert all(reference.FIGURES[f].lab == lab for f in entry["figures"])
        for picture in entry["timelines"]:  # each named picture is committed beside it
            assert (reference.path("h100") / picture).is_file()
    assert all(e["status"] == "ok" for e in ref["labs"].values()) and not ref["failed"]
    assert (ref["nbval"]["passed"], ref["nbval"]["failed"]) == (287, 0)
    # every benchmark ran, all in the one run
    assert all(b["status"] == "ok" and not b.get("run") for b in ref["benchmarks"].values())
    assert sorted(ref["benchmarks"]) == ["checkpoint", "cp", "ddp", "ep", "fsdp", "launch"]
    want = {"cp_zigzag_over_torch": 0.9285, "cp_zigzag_over_dense": 1.1901,
            "ddp_ours_over_torch": 0.8865, "ckpt_save_over_dcp": 0.8018,
            "ckpt_load_over_dcp": 0.4204, "ep_ours_over_dense": 1.1693,
            "launch_cold_s": 4.6841, "launch_warm_ms": 1.9043}
    for figure, v in want.items():
        assert reference.value("h100", figure, ref) == pytest.approx(v)
    assert reference.value("h100", "ckpt_async_blocked", ref) == pytest.approx(0.257)
    # the row printed for the README is the one the README carries
    assert ref["readme_row"] == gpucheck.readme_row(ref)
    assert ref["readme_row"] in (ROOT / "README.md").read_text()



def test_the_h200_summary_is_a_second_whole_run_beside_the_h100s():
    """make gpu-check on one H200, 2026-11-28, at b1ff3c2: one call, first try."""
    ref = reference.load("h200")
    assert ref["machine"]["gpu"] == "NVIDIA H200" and ref["commit"] == "b1ff3c2"
    assert ref["date"] == "2026-11-28" and ref["machine"]["nccl"] == "2.28.9"
    assert all(e["status"] == "ok" for e in ref["labs"].values()) and not ref["failed"]
    assert sorted(ref["labs"]) == [f"{n:02d}" for n in range(9)]
    for entry in ref["labs"].values():
        for picture in entry["timelines"]:
            assert (reference.path("h200") / picture).is_file()
    assert (ref["nbval"]["passed"], ref["nbval"]["failed"]) == (290, 0)
    want = {"cp_zigzag_over_torch": 0.9347, "ddp_ours_over_torch": 0.8969,
            "fsdp_full_over_fsdp2": 0.5814, "ckpt_load_over_dcp": 0.4821,
            "ep_ours_over_dense": 1.1467, "launch_cold_s": 5.6759}
    for figure, v in want.items():
        assert reference.value("h200", figure, ref) == pytest.approx(v)
    assert ref["readme_row"] == gpucheck.readme_row(ref)
    assert ref["readme_row"] in (ROOT / "README.md").read_text()
    # the labs quote the H100 unless told otherwise
    assert "H200" in reference.line("07", "cp_zigzag_over_torch", name="h200")
    assert "H100" in reference.line("07", "cp_zigzag_over_torch")

def test_a_line_puts_the_students_figure_beside_the_gpus(tmp_path, monkeypatch):
    text = reference.line("07", "cp_zigzag_over_torch", mine=3.1)
    assert "\n" not in text and "yours 3.10" in text and "0.93" in text and "H100" in text
    assert "--seq 8192" in text and "2026-11-28" in text
    assert "yours" not in reference.line("08", "ckpt_save_over_dcp")
    assert "26%" in reference.line("08", "ckpt_async_blocked")
    with pytest.raises(KeyError, match="Lab 07"):
        reference.line("02", "cp_zigzag_over_torch")
    every = reference.lines("01").splitlines()
    assert len(every) == 1 and "01_collectives.ipynb ok" in every[0]  # no world-1 figure
    # a passing notebook says nothing more, one that failed there says why
    assert every[0].endswith(")")
    failed = reference.load("h100")
    failed["labs"]["03"]["status"] = "failed"
    failed["notebooks"]["03"]["error"] = "Timeout: stopped after 275 s (wall)"
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text(json.dumps(failed))
    monkeypatch.setenv("COURSE_LIB_REFERENCE", str(tmp_path))
    assert reference.notebook_line("03", "old").endswith(
        "failed in 183 s (NPROC=1, nccl, quick; 2026-11-28): Timeout: stopped after 275 s (wall)")


def test_references_are_found_elsewhere_and_installed_with_the_package(tmp_path, monkeypatch):
    (tmp_path / "t4").mkdir()
    (tmp_path / "t4" / "summary.json").write_text(json.dumps({"labs": {}}))
    monkeypatch.setenv("COURSE_LIB_REFERENCE", str(tmp_path))
    assert reference.load("t4") == {"labs": {}} and {"h100", "t4"} <= set(reference.available())
    assert any(str(r).endswith("share/course_lib/reference") for r in reference.roots())
    with pytest.raises(FileNotFoundError, match="no reference 'a100'"):
        reference.load("a100")
    # every committed reference is in the wheel's data files (<prefix>/share/course_lib/reference)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    listed = {f for files in data.values() for f in files}
    for summary in (ROOT / "reference").glob("*/summary.json"):
        name = summary.parent.name
        if name == "cpu-rehearsal":  # written by each machine's rehearsal, never committed
            continue
        assert f"reference/{name}/summary.json" in listed
        assert data[f"share/course_lib/reference/{name}"] == [f"reference/{name}/summary.json"]
        assert re.fullmatch(r"[a-z0-9-]+", name)
