"""Execute every solution notebook with papermill (what ``make run`` does).

    python -m course_lib.grading.runall --quick [--out runs/DATE] [--nproc 2] [--only 00,01]

Each notebook gets the parameters QUICK, NPROC, BACKEND and OUTPUT_DIR; it
saves its timelines (PNG) and Chrome traces (JSON) under OUTPUT_DIR, and the
executed notebook lands beside them, with ``summary.csv`` (notebook, status,
seconds, error). Exits 1 if any notebook failed.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path


def run_notebooks(solutions, out, params, only=None, timeout=1800):
    import papermill as pm

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for nb in sorted(Path(solutions).glob("[0-9][0-9]_*.ipynb")):
        if only and nb.name[:2] not in only:
            continue
        started = time.perf_counter()
        print(f"=== {nb.name}", flush=True)
        try:
            pm.execute_notebook(str(nb), str(out / nb.name), kernel_name="python3",
                                parameters={**params, "OUTPUT_DIR": str(out)},
                                cwd=str(nb.parent), log_output=True,
                                execution_timeout=timeout, progress_bar=False)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported per notebook, then summarised
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        results.append((nb.name, time.perf_counter() - started, error))
    return results


def write_summary(path, results):
    """One row per notebook: notebook, status (ok / failed), seconds, error."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", "status", "seconds", "error"])
        for name, seconds, error in results:
            writer.writerow([name, "ok" if error is None else "failed", f"{seconds:.1f}",
                             error or ""])


def main(argv=None):
    import logging

    # papermill's --log-output goes through logging: show each cell's output live
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.runall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--solutions", default="solutions")
    parser.add_argument("--out", default=None, help="default: runs/<timestamp>")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nproc", type=int, default=None)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--only", default=None, help="comma-separated notebook numbers")
    ns = parser.parse_args(argv)
    out = ns.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
    params = {"QUICK": ns.quick, "BACKEND": ns.backend}
    if ns.nproc:
        params["NPROC"] = ns.nproc
    only = set(ns.only.split(",")) if ns.only else None
    results = run_notebooks(ns.solutions, out, params, only)
    if not results:
        print("no notebooks ran", file=sys.stderr)
        return 1
    print(f"\n{'notebook':<28}{'seconds':>9}  status")
    for name, seconds, error in results:
        print(f"{name:<28}{seconds:>9.1f}  {'ok' if error is None else 'FAILED ' + error}")
    write_summary(Path(out) / "summary.csv", results)
    print(f"\nexecuted notebooks, timelines, traces and summary.csv: {Path(out).resolve()}")
    return 0 if all(e is None for *_, e in results) else 1


if __name__ == "__main__":
    sys.exit(main())
