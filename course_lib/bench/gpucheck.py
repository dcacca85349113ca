"""``make gpu-check``: the one command for a machine with one GPU.

    python -m course_lib.bench.gpucheck                        # NCCL, world 1, reference/<gpu>/
    python -m course_lib.bench.gpucheck --backend gloo --nproc 1 --out reference/cpu-rehearsal
    python -m course_lib.bench.gpucheck --only 00,launch       # a subset (tests)

What it runs, each step in processes of its own:

1. ``notebooks``: every solution notebook, quick setting, ``NPROC=--nproc``,
   ``BACKEND=--backend``, with papermill, one process per notebook
   (:func:`course_lib.grading.runall.notebook_task`), ``--parallel`` at once
   (default: all of them on a GPU machine, 2 on a CPU one).
2. ``nbval``: ``pytest <notebook>`` (nbval, the notebooks' own defaults) one process
   per notebook, as ``pytest -n K --dist loadfile`` would (pytest-xdist is not a
   dependency of the course), ``--nbval-workers`` at once (default ``--parallel``).
3. ``tests_gpu``: ``pytest tests/gpu tests/test_one_gpu_gloo.py`` (the first skip where no
   GPU is seen; the second runs gloo ranks beside the GPU, the student's common case).
4. ``benchmarks``: ``python -m course_lib.bench cp|fsdp|ep|ddp|checkpoint|launch`` one
   at a time, each with ``--json``: the numbers the bench's functions returned are kept
   in the summary with the ratios they give (:data:`course_lib.bench.reference.FIGURES`).

What runs beside what: steps 1, 2 and 3 start together. On a GPU, the notebooks use
the GPU (NCCL, world 1) and nbval mostly the CPU cores (the defaults ask for 2-4 ranks,
which run on gloo with one GPU). The GPU-bound benchmarks (cp, fsdp, ep) start when the
notebooks and tests/gpu are done, while nbval may still run; the ones whose times are
set by the CPU or the launch path (ddp's 4 ms steps, checkpoint on 4 gloo ranks, launch)
wait for nbval as well. One H100 (16 cores) ran it all in 319 s (2026-11-28): the
notebooks 104-191 s each side by side, nbval 191 s on 9 workers beside them, the
benchmarks 120 s (:data:`BENCH_ESTIMATE_S`). Kernels talk over Unix sockets
(:mod:`course_lib.grading.kernels`): with tcp, one kernel of eighteen lost its port. On a GPU the
whole is held to ``--budget-s`` (360 s; 0: no limit): each step's timeout is cut so that
the benchmarks after it still fit (the notebooks end by 360 - 122 s, nbval by 360 - 56 s),
and a step that would get under 10 s is not started (and counts as failed). With gloo
(the CPU rehearsal) there is no budget, the benchmarks use smaller sizes, and at most
``--parallel`` processes run at once (2 on a 2-core machine: about 13 minutes).

It writes ``<out>/summary.json`` (machine, settings, notebooks, nbval, tests_gpu,
benchmarks, labs: each lab's notebook and figures, timelines, total seconds), copies
one or two timeline pictures per lab to ``<out>/timelines/`` (downscaled, a few MB in
all), prints the README's "Where this was tested" row, and exits 1 if anything failed
(after writing the summary). Executed notebooks, logs and every picture stay in
``--work`` (default ``runs/gpu-check-<time>/``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import sys
import time
from pathlib import Path

from course_lib.bench.gpucheck_benches import (  # noqa: F401  (tests read them here too)
    BENCH_ESTIMATE_S, BENCHES, CPU_BOUND, GPU_BOUND, bench_args, bench_figures)
from course_lib.bench.gpucheck_summary import (  # noqa: F401  (tests read them here too)
    MACHINE_KEYS, MAX_PNG_BYTES, MAX_PNG_PX, SUMMARY_KEYS, _commit, _s, gpu_slug, lab_entries,
    machine_info, parse_junit, pytest_result, readme_row, report, select_timelines)
from course_lib.grading import runall

STEPS = ("notebooks", "nbval", "tests_gpu", "benchmarks")
TIMEOUTS = {  # wall seconds per process: (on a GPU, on the CPU rehearsal)
    "notebook": (300, 1800), "nbval": (330, 2400), "tests_gpu": (180, 600), "bench": (150, 900)}


def share_cores(tasks, parallel, nbval_workers, gpu):
    """Give every process of the run (kernels, pytest workers, their ranks) an equal
    share of the cores through ``OMP_NUM_THREADS`` in each task's environment, unless the caller set it. Left alone,
    each job's ranks take ``cores // nproc`` threads as if the machine were theirs: on the
    H100 run of 2026-11-27 (16 cores, 9 notebooks beside 9 nbval workers) the spinning
    threads starved gloo, so a two-rank check did not end in 30 s and 7 notebooks ran
    out of time. Returns the thread count the children get."""
    import os

    at_once = min(len(tasks["notebooks"]), parallel) + min(len(tasks["nbval"]), nbval_workers)
    if not gpu:  # the rehearsal caps the whole run at ``parallel`` processes
        at_once = min(at_once, parallel)
    at_once += bool(tasks["tests_gpu"])
    threads = int(os.environ.get("OMP_NUM_THREADS")
                  or max(1, (os.cpu_count() or 1) // max(1, at_once)))
    for task in (t for step in tasks.values() for t in step):
        task.env = {**(task.env or {}), "OMP_NUM_THREADS": str(threads)}
    return threads


def parse_only(text):
    """``--only``: steps (notebooks, nbval, tests_gpu, benchmarks), notebook numbers
    (``00``), ``nbval:NN`` and bench names. Returns (notebooks, nbval, tests_gpu, benches):
    None = all, an empty set = none."""
    if not text:
        return None, None, True, list(BENCHES)
    nbs, nbval, tests, benches = set(), set(), False, []
    for tok in (t.strip() for t in text.split(",") if t.strip()):
        if tok == "notebooks":
            nbs = None
        elif tok == "nbval":
            nbval = None
        elif tok in ("tests_gpu", "tests-gpu", "tests/gpu"):
            tests = True
        elif tok in ("benchmarks", "bench"):
            benches = list(BENCHES)
        elif tok in BENCHES:
            benches.append(tok)
        elif re.fullmatch(r"\d\d", tok):
            if nbs is not None:
                nbs.add(tok)
        elif re.fullmatch(r"nbval:\d\d", tok):
            if nbval is not None:
                nbval.add(tok[-2:])
        else:
            raise ValueError(f"--only: unknown {tok!r} (steps {', '.join(STEPS)}, notebook "
                             f"numbers NN, nbval:NN, benches {', '.join(BENCHES)})")
    return nbs, nbval, tests, [b for b in BENCHES if b in benches]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench.gpucheck",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--out", default=None,
                        help="default: reference/<GPU name, slugged> (reference/cpu-rehearsal "
                             "without CUDA)")
    parser.add_argument("--only", default=None,
                        help="comma-separated: steps (notebooks,nbval,tests_gpu,benchmarks), "
                             "notebook numbers (00), nbval:NN, benches (cp,ddp,...)")
    parser.add_argument("--parallel", type=int, default=None,
                        help="notebooks side by side (default: all on a GPU machine, 2 without)")
    parser.add_argument("--nbval-workers", type=int, default=None, help="default: --parallel")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="hold the whole to this many seconds (default 360 on a GPU, "
                             "none without; 0: none)")
    parser.add_argument("--notebook-timeout", type=float, default=None)
    parser.add_argument("--nbval-timeout", type=float, default=None)
    parser.add_argument("--bench-timeout", type=float, default=None)
    parser.add_argument("--solutions", default="solutions")
    parser.add_argument("--work", default=None, help="default: runs/gpu-check-<time>")
    parser.add_argument("--machine", default=None, help="a label for the machine (README row)")
    ns = parser.parse_args(argv)
    try:
        sel_nbs, sel_nbval, run_tests, benches = parse_only(ns.only)
    except ValueError as exc:
        parser.error(str(exc))

    started, t0 = datetime.datetime.now().astimezone(), time.monotonic()
    machine = machine_info(ns.machine)
    gpu = machine["gpu"] is not None
    if ns.backend == "nccl" and not gpu:
        parser.error("--backend nccl needs a CUDA GPU (torch sees none); the CPU rehearsal is "
                     "--backend gloo --out reference/cpu-rehearsal")
    # the GPU profile (the H100 run's bench sizes, the time budget, every notebook at once)
    # where the job's backend uses the GPU; gloo ranks stay on the CPU, GPU or not
    gpu = gpu and ns.backend == "nccl"
    solutions = Path(ns.solutions).resolve()
    root = solutions.parent
    out = Path(ns.out or Path("reference") / (gpu_slug(machine["gpu"]) if gpu
                                              else "cpu-rehearsal")).resolve()
    work = Path(ns.work or Path("runs") / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    all_nbs = runall.notebooks(solutions)
    parallel = ns.parallel or (len(all_nbs) if gpu else 2)
    nbval_workers = ns.nbval_workers or parallel
    budget = ns.budget_s if ns.budget_s is not None else (360.0 if gpu else 0.0)
    deadline = t0 + budget if budget else None
    which = 0 if gpu else 1
    timeout = {k: v[which] for k, v in TIMEOUTS.items()}
    timeout.update({k: v for k, v in (("notebook", ns.notebook_timeout),
                                      ("nbval", ns.nbval_timeout),
                                      ("bench", ns.bench_timeout)) if v})
    print(f"gpu-check: {machine['label']}, torch {machine['torch']}, backend {ns.backend}, "
          f"world {ns.nproc}; summary in {out}, run folder {work}"
          + (f"; budget {budget:.0f} s" if budget else ""), flush=True)

    # the budget: what must still fit after each step
    after_nbs = sum(BENCH_ESTIMATE_S[b] for b in benches)
    after_nbval = sum(BENCH_ESTIMATE_S[b] for b in benches if b in CPU_BOUND)
    tasks = {"notebooks": [], "nbval": [], "tests_gpu": [], "benchmarks": []}
    params = {"QUICK": True, "NPROC": ns.nproc, "BACKEND": ns.backend}
    for nb in runall.notebooks(solutions, sel_nbs) if sel_nbs != set() else []:
        task = runall.notebook_task(nb, work, params, wall_timeout=timeout["notebook"])
        task.deadline = deadline and deadline - after_nbs
        tasks["notebooks"].append(task)
    py = sys.executable
    for nb in runall.notebooks(solutions, sel_nbval) if sel_nbval != set() else []:
        junit = work / "nbval" / f"{nb.stem}.xml"
        task = runall.Task(name=f"nbval {nb.name}", pool="nbval",
                           argv=[py, "-m", "pytest", str(nb.relative_to(root)), "-p",
                                 "no:cacheprovider", "-p", "course_lib.grading.kernels",
                                 "-q", "-rf", f"--junitxml={junit}"],
                           log=work / "logs" / f"nbval_{nb.stem}.log", cwd=str(root),
                           timeout=timeout["nbval"], extra={"junit": junit, "nb": nb.name})
        task.deadline = deadline and deadline - after_nbval
        tasks["nbval"].append(task)
    if run_tests:
        junit = work / "tests_gpu.xml"
        task = runall.Task(name="tests/gpu", pool="tests_gpu",
                           # the GPU tests, and one GPU with several gloo ranks (the
                           # student's case: ranks stay off the GPU, FSDP2 included)
                           argv=[py, "-m", "pytest", "tests/gpu", "tests/test_one_gpu_gloo.py",
                                 "-p", "no:cacheprovider",
                                 "-q", "-rs", f"--junitxml={junit}"],
                           log=work / "logs" / "tests_gpu.log", cwd=str(root),
                           timeout=timeout["tests_gpu"], extra={"junit": junit})
        task.deadline = deadline and deadline - after_nbs
        tasks["tests_gpu"].append(task)
    for what in benches:
        args = bench_args(what, ns.nproc, ns.backend, gpu)
        result = work / "bench" / f"{what}.json"
        after = ("notebooks", "tests_gpu") + (("nbval",) if what in CPU_BOUND else ())
        task = runall.Task(name=f"bench {what}", pool="benchmarks", after=after,
                           argv=[py, "-m", "course_lib.bench", what, *args, "--json", str(result)],
                           log=work / "logs" / f"bench_{what}.log", cwd=str(root),
                           timeout=timeout["bench"], env={"PYTHONUNBUFFERED": "1"},
                           extra={"json": result, "what": what, "args": args})
        task.deadline = deadline
        tasks["benchmarks"].append(task)
    every = [t for step in STEPS for t in tasks[step]]
    threads = share_cores(tasks, parallel, nbval_workers, gpu)
    for folder in ("bench", "nbval", "logs"):
        (work / folder).mkdir(parents=True, exist_ok=True)
    runall.run_tasks(every, limits={"notebooks": parallel, "nbval": nbval_workers,
                                    "benchmarks": 1},
                     total=None if gpu else parallel, deadline=deadline)

    summary = {"schema": 1, "date": started.date().isoformat(), "started": started.isoformat(
        timespec="seconds"), "source": "python -m course_lib.bench.gpucheck", "machine": machine,
        "commit": _commit(root),
        "settings": {"backend": ns.backend, "nproc": ns.nproc, "quick": True,
                     "parallel": parallel, "nbval_workers": nbval_workers,
                     "budget_s": budget or None, "only": ns.only, "omp_threads": threads,
                     "argv": sys.argv[1:] if argv is None else list(argv)},
        "work": str(work)}
    if tasks["notebooks"]:
        summary["notebooks"] = {}
        for task in tasks["notebooks"]:
            name, seconds, error = runall.notebook_result(task)
            summary["notebooks"][name[:2]] = {"notebook": name, "status": "ok" if error is None
                                              else "failed", "seconds": round(seconds, 1),
                                              "error": error, "started_s": _s(task.started_s)}
        runall.write_summary(work / "summary.csv", [runall.notebook_result(t)
                                                    for t in tasks["notebooks"]])
    if tasks["nbval"]:
        per = {t.extra["nb"][:2]: pytest_result(t) for t in tasks["nbval"]}
        ran = [t for t in tasks["nbval"] if t.started_s is not None]
        wall = (max(t.started_s + t.seconds for t in ran) - min(t.started_s for t in ran)
                if ran else 0.0)
        summary["nbval"] = {
            "status": "ok" if all(p["status"] == "ok" for p in per.values()) else "failed",
            "mode": "one pytest process per notebook (pytest-xdist is not a dependency)",
            "workers": nbval_workers, "seconds": round(wall, 1),
            **{k: sum(p[k] for p in per.values())
               for k in ("passed", "failed", "errors", "skipped")},
            "failures": [{"notebook": t.extra["nb"], **f} for t in tasks["nbval"]
                         for f in per[t.extra["nb"][:2]]["failures"]],
            "per_notebook": {k: {x: v[x] for x in ("status", "passed", "failed", "errors",
                                                   "skipped", "seconds")}
                             for k, v in per.items()}}
    if tasks["tests_gpu"]:
        summary["tests_gpu"] = pytest_result(tasks["tests_gpu"][0])
    if tasks["benchmarks"]:
        summary["benchmarks"] = {}
        for task in tasks["benchmarks"]:
            what = task.extra["what"]
            command = shlex.join([what, *task.extra["args"]])
            entry = {"command": f"python -m course_lib.bench {command}",
                     "seconds": round(task.seconds, 1), "started_s": _s(task.started_s)}
            try:
                if task.not_run or task.timed_out or task.returncode != 0:
                    raise RuntimeError(task.not_run or (
                        f"stopped after {task.seconds:.0f} s (wall timeout)" if task.timed_out
                        else f"exit {task.returncode}: {task.log_tail(1)[:300]}"))
                raw = json.loads(Path(task.extra["json"]).read_text())
                figures, times, details = bench_figures(what, raw)
                entry.update(status="ok", figures=figures, times_ms=times, details=details,
                             result=raw, error=None)
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                entry.update(status="failed", figures={}, error=runall._error_line(exc))
            summary["benchmarks"][what] = entry
    labs_run = sorted(summary.get("notebooks", {}))
    summary["timelines"] = select_timelines(work, out / "timelines", labs_run)
    summary["timelines_note"] = (None if summary["timelines"] else
                                 "no timeline pictures: no notebook ran, or none saved one")
    summary["labs"] = lab_entries(summary)
    failed = ([f"notebook {k}" for k, v in summary.get("notebooks", {}).items()
               if v["status"] != "ok"]
              + (["nbval"] if summary.get("nbval", {}).get("status", "ok") != "ok" else [])
              + (["tests/gpu"] if summary.get("tests_gpu", {}).get("status", "ok") != "ok"
                 else [])
              + [f"bench {k}" for k, v in summary.get("benchmarks", {}).items()
                 if v["status"] != "ok"])
    summary["failed"] = failed
    summary["ok"] = not failed
    summary["total_seconds"] = round(time.monotonic() - t0, 1)
    summary["readme_row"] = readme_row(summary)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(report(summary, out))
    return 0 if summary["ok"] else 1




if __name__ == "__main__":
    sys.exit(main())
