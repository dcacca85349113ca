"""make gpu-check's driver (course_lib.bench.gpucheck) rehearsed on the CPU: gloo at world
1, a cheap subset of its steps, and the summary's schema; its pieces on made-up input."""
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from course_lib.bench import gpucheck, reference
from course_lib.grading import runall

ROOT = Path(__file__).resolve().parents[2]


def run_driver(tmp_path, *args, timeout=900):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "course_lib.bench.gpucheck", "--backend", "gloo",
                           "--nproc", "1", "--out", str(out), "--work", str(work), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    summary = json.loads((out / "summary.json").read_text())
    return proc, summary, out


def check_schema(summary):
    assert set(gpucheck.SUMMARY_KEYS) <= set(summary)
    assert set(gpucheck.MACHINE_KEYS) <= set(summary["machine"])
    assert summary["machine"]["gpu"] is None and summary["machine"]["nccl"] is None
    assert summary["machine"]["cpu_count"] >= 1 and summary["machine"]["torch"]
    assert summary["settings"]["backend"] == "gloo" and summary["settings"]["nproc"] == 1
    assert sorted(summary["labs"]) == list(reference.LABS)
    assert summary["readme_row"].startswith(f"| {summary['date']} |")
    assert summary["readme_row"].count("|") == 8 and summary["total_seconds"] > 0
    for bench in summary.get("benchmarks", {}).values():
        assert {"command", "status", "seconds", "figures", "error"} <= set(bench)
        assert set(bench["figures"]) <= set(reference.FIGURES)


@pytest.mark.slow  # a bench's job and its summary: CI runs it after make test
def test_the_rehearsal_of_one_bench_writes_the_summary_and_the_readme_row(tmp_path):
    proc, summary, out = run_driver(tmp_path, "--only", "launch")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_schema(summary)
    assert summary["ok"] and summary["failed"] == [] and "notebooks" not in summary
    launch = summary["benchmarks"]["launch"]
    assert launch["command"] == "python -m course_lib.bench launch --nproc 4 --repeat 10"
    assert launch["figures"]["launch_cold_s"] > 0 and launch["result"]["nproc"] == 4
    assert summary["labs"]["00"]["figures"] == launch["figures"]
    assert summary["readme_row"] in proc.stdout and "launch 4 ranks" in summary["readme_row"]


@pytest.mark.slow
def test_the_rehearsal_of_a_notebook_and_a_bench_keeps_its_timelines(tmp_path):
    proc, summary, out = run_driver(tmp_path, "--only", "00,checkpoint")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_schema(summary)
    nb = summary["notebooks"]["00"]
    assert nb["notebook"] == "00_launch.ipynb" and nb["status"] == "ok" and nb["seconds"] > 0
    assert list(summary["notebooks"]) == ["00"] and summary["labs"]["00"]["status"] == "ok"
    assert summary["labs"]["01"]["status"] == "not run"
    kept = summary["timelines"]["00"]
    assert 1 <= len(kept) <= 2 and all((out / f).stat().st_size < gpucheck.MAX_PNG_BYTES
                                       for f in kept)
    figures = summary["benchmarks"]["checkpoint"]["figures"]
    assert set(figures) == {"ckpt_save_over_dcp", "ckpt_load_over_dcp", "ckpt_async_blocked"}
    assert summary["labs"]["08"]["figures"] == figures
    assert "1/1" in summary["readme_row"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is there")
def test_nccl_without_a_gpu_is_refused_with_the_rehearsal_named():
    proc = subprocess.run([sys.executable, "-m", "course_lib.bench.gpucheck", "--only", "launch"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--backend gloo" in proc.stderr


def test_only_names_steps_notebooks_and_benches():
    assert gpucheck.parse_only(None) == (None, None, True, list(gpucheck.BENCHES))
    assert gpucheck.parse_only("00,launch") == ({"00"}, set(), False, ["launch"])
    assert gpucheck.parse_only("notebooks,nbval:03,ddp,cp") == (None, {"03"}, False, ["cp", "ddp"])
    with pytest.raises(ValueError, match="unknown 'gossip'"):
        gpucheck.parse_only("gossip")


def test_gpu_names_become_folder_names():
    assert gpucheck.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpucheck.gpu_slug("NVIDIA A100-SXM4-40GB") == "a100"
    assert gpucheck.gpu_slug("NVIDIA GeForce RTX 4090") == "rtx-4090"


def test_the_figures_are_the_ratios_the_benches_print():
    """Each bench's JSON, shaped as it writes it, gives the ratios of its printed table
    (the H100's numbers of 2026-11-27)."""
    cp = {"timed": {"step_s": {"zigzag": 0.06617, "contiguous": 0.07158, "torch": 0.00963,
                               "dense": 0.00754}, "max_diff": {}, "torch_error": None}}
    f, times, _ = gpucheck.bench_figures("cp", cp)
    assert round(f["cp_zigzag_over_torch"], 2) == 6.87
    assert round(f["cp_zigzag_over_dense"], 2) == 8.78
    assert times["zigzag"] == pytest.approx(66.17)
    ckpt = {"save_s": {"ours": 0.2721, "dcp": 0.3233}, "load_s": {"ours": 0.0534, "dcp": 0.0783},
            "async_blocked_s": 0.0196, "sync_save_s": 0.2721}
    f, _, _ = gpucheck.bench_figures("checkpoint", ckpt)
    assert (round(f["ckpt_save_over_dcp"], 2), round(f["ckpt_load_over_dcp"], 2)) == (0.84, 0.68)
    fsdp = {name: {"step_s": t, "state_bytes": 1, "peak_bytes": 1} for name, t in
            {"DDP": 35.8, "FSDP full": 35.3, "FSDP none": 33.4, "torch FSDP2": 51.7}.items()}
    f, _, details = gpucheck.bench_figures("fsdp", fsdp)
    assert round(f["fsdp_full_over_fsdp2"], 2) == 0.68
    assert round(f["fsdp_min_over_fsdp2"], 2) == 0.65
    assert details["over_fsdp2"]["torch FSDP2"] == 1.0
    ddp = {"step_s": {"NaiveDDP": 5.3, "FlatDDP": 4.8, "DDP (ours)": 5.3, "torch DDP": 4.1},
           "overlap": 1.0, "sweep": {"1.0": {"ours_s": 5.1, "torch_s": 4.0}}}
    f, _, details = gpucheck.bench_figures("ddp", ddp)
    assert round(f["ddp_ours_over_torch"], 2) == 1.29
    assert details["sweep_ours_over_torch"]["1.0"] > 1
    f, _, _ = gpucheck.bench_figures("ep", {"step_s": {"ours": 1.0, "dense": 1.16}, "ratio": 1.16,
                                            "tokens_per_s": {}})
    assert f == {"ep_ours_over_dense": 1.16}
    # torch's context_parallel did not run: the ratio against it is left out, not made up
    del cp["timed"]["step_s"]["torch"]
    cp["timed"]["torch_error"] = "NotImplementedError: ..."
    f, _, details = gpucheck.bench_figures("cp", cp)
    assert "cp_zigzag_over_torch" not in f and details["torch_error"].startswith("NotImpl")


def test_junit_reports_become_counts_and_failures(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" tests="4">'
        '<testcase classname="solutions.00_launch.ipynb" name="Cell 1"/>'
        '<testcase classname="solutions.00_launch.ipynb" name="Cell 2">'
        '<failure message="ValueError: boom">trace\nValueError: boom</failure></testcase>'
        '<testcase classname="x" name="t"><skipped message="needs a CUDA GPU"/></testcase>'
        '<testcase classname="x" name="u"><error message="fixture broke"/></testcase>'
        # nbval's report: a colored traceback (ESC written as #x1B), the message cut short
        '<testcase classname="solutions.07.ipynb" name="Cell 3"><failure message="[+9 more '
        'lines; full report in element text]">#x1B[94mCell 3: Cell execution caused an '
        'exception\n#x1B[31mImportError#x1B[39m: cannot import name \'plain\'\n</failure>'
        '</testcase></testsuite></testsuites>')
    got = gpucheck.parse_junit(xml)
    assert (got["passed"], got["failed"], got["skipped"], got["errors"]) == (1, 2, 1, 1)
    assert got["failures"][0] == {"test": "solutions.00_launch.ipynb::Cell 2", "kind": "failed",
                                  "message": "ValueError: boom"}
    assert got["failures"][1]["message"] == "fixture broke"
    assert got["failures"][2]["message"] == "ImportError: cannot import name 'plain'"


def test_timelines_kept_are_one_or_two_per_lab_and_small(tmp_path):
    from PIL import Image

    work, dest = tmp_path / "work", tmp_path / "out" / "timelines"
    work.mkdir()
    Image.new("RGB", (3000, 1000), "white").save(work / "02_timeline.png")
    for name in ("02_buckets.png", "02_gpt_loss.png", "04_bubble.png", "05_grids.png"):
        Image.new("RGB", (300, 200), "white").save(work / name)
    kept = gpucheck.select_timelines(work, dest, ["02", "04", "05"])
    assert kept == {"02": ["timelines/02_timeline.png", "timelines/02_buckets.png"],
                    "04": ["timelines/04_bubble.png"]}
    with Image.open(dest / "02_timeline.png") as im:
        assert im.width == gpucheck.MAX_PNG_PX


@pytest.mark.slow  # waits out a timeout: CI runs it after make test
def test_processes_side_by_side_are_stopped_with_everything_under_them(tmp_path):
    """A task past its timeout is ended with its children; ``after`` orders tasks; a task
    the time budget cannot fit is not started."""
    pid_file = tmp_path / "child.pid"
    hang = [sys.executable, "-c", "import subprocess, sys, time; "
            "p = subprocess.Popen(['sleep', '120']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)"]
    quick = [sys.executable, "-c", "print('hello')"]
    tasks = [runall.Task("hang", hang, tmp_path / "hang.log", timeout=3, pool="a"),
             runall.Task("then", quick, tmp_path / "then.log", pool="b", after=("a",)),
             runall.Task("late", quick, tmp_path / "late.log", pool="c", after=("then",),
                         deadline=time.monotonic() + 1)]
    started = time.monotonic()
    runall.run_tasks(tasks, echo=False)
    assert time.monotonic() - started < 60
    hung, then, late = tasks
    assert hung.timed_out and hung.returncode is not None
    assert not psutil.pid_exists(int(pid_file.read_text())) or \
        psutil.Process(int(pid_file.read_text())).status() == psutil.STATUS_ZOMBIE
    assert then.returncode == 0 and then.started_s >= hung.started_s + 3
    assert "hello" in then.log.read_text()
    assert late.not_run and "time budget" in late.not_run and late.returncode is None


def test_every_process_of_the_run_gets_its_share_of_the_cores(monkeypatch):
    """18 processes on 16 cores get a thread each (the starved H100 run gave each job
    cores // nproc); the rehearsal counts only the ``parallel`` it runs at once; a
    caller's own OMP_NUM_THREADS stands. The run's own environment is left as it was."""
    import os

    from course_lib.grading import runall

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def tasks(notebooks, nbval):
        def make(n, pool):
            return [runall.Task(name=f"{pool}{i}", pool=pool, argv=["true"], log=None,
                                env={"PYTHONUNBUFFERED": "1"}) for i in range(n)]
        return {"notebooks": make(notebooks, "notebooks"), "nbval": make(nbval, "nbval"),
                "tests_gpu": [], "benchmarks": make(1, "benchmarks")}

    every = tasks(9, 9)
    assert gpucheck.share_cores(every, 9, 9, gpu=True) == 1
    assert all(t.env == {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
               for step in every.values() for t in step)
    assert "OMP_NUM_THREADS" not in os.environ
    assert gpucheck.share_cores(tasks(9, 0), 9, 9, gpu=True) == 1  # 16 // 9
    assert gpucheck.share_cores(tasks(3, 0), 9, 9, gpu=True) == 5
    assert gpucheck.share_cores(tasks(9, 9), 2, 2, gpu=False) == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert gpucheck.share_cores(tasks(9, 9), 9, 9, gpu=True) == 3
