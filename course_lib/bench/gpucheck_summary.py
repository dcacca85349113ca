"""What ``make gpu-check`` records and prints (:mod:`course_lib.bench.gpucheck`): the
machine, pytest's junit reports as counts, the timelines kept per lab, each lab's entry,
the README's "Where this was tested" row and the closing report."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

from course_lib.bench.reference import FIGURES, LABS

# every summary.json has these (and each step it ran, under the step's name)
SUMMARY_KEYS = ("schema", "date", "source", "machine", "commit", "settings", "timelines",
                "timelines_note", "labs", "failed", "ok", "total_seconds", "readme_row")
MACHINE_KEYS = ("label", "gpu", "gpu_count", "torch", "cuda", "nccl", "python", "cpu_count",
                "platform")
PYTEST_KEYS = ("status", "passed", "failed", "errors", "skipped", "seconds", "failures")
# the timelines kept per lab, first match wins (then any NN_*timeline*.png)
TIMELINES = {"00": ["00_timeline.png", "00_ping_pong.png"], "01": ["01_timeline.png"],
             "02": ["02_timeline.png", "02_buckets.png"],
             "03": ["03_prefetch.png", "03_memory.png"],
             "04": ["04_timeline.png", "04_bubble.png"], "05": ["05_timeline.png"],
             "06": ["06_losses.png", "06_plan.png"],
             "07": ["07_ring_timeline.png", "07_moe_timeline.png"],
             "08": ["08_resume.png", "08_goodput.png"]}
MAX_PNG_PX = 1400
MAX_PNG_BYTES = 1 << 20
MAX_TIMELINE_BYTES = 5 << 20


# -- the machine ------------------------------------------------------------------------

def gpu_slug(name):
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA GeForce RTX 4090' -> 'rtx-4090'."""
    words = [w for w in re.split(r"[^a-z0-9]+", (name or "").lower())
             if w and w not in ("nvidia", "geforce", "tesla", "amd", "radeon", "instinct")]
    kept = []
    for w in words:
        kept.append(w)
        if re.search(r"\d", w):
            break
    return "-".join(kept) or "gpu"


def machine_info(label=None):
    import torch

    try:  # a CUDA that answers is_available() but cannot name its device is none
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except (RuntimeError, AssertionError, AttributeError):
        gpu = None
    cuda = gpu is not None
    count = torch.cuda.device_count() if cuda else 0
    nccl = None
    if cuda:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a build without NCCL
            nccl = None
    cpus = os.cpu_count()
    default = (f"{count}x {gpu}, {cpus} CPU cores" if cuda
               else f"CPU only ({platform.machine()}), {cpus} cores")
    return {"label": label or default, "gpu": gpu, "gpu_count": count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": nccl, "python": platform.python_version(),
            "cpu_count": cpus, "platform": platform.platform()}


def _commit(root):
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# -- reading what the processes left ------------------------------------------------------

def parse_junit(path):
    """{"passed", "failed", "errors", "skipped", "failures": [{"test", "message"}]}."""
    root = ET.parse(path).getroot()
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for case in root.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        kinds = {child.tag for child in case}
        for tag, key in (("failure", "failed"), ("error", "errors")):
            for child in case.iter(tag):
                out[key] += 1
                out["failures"].append({"test": test, "kind": key,
                                        "message": _failure_line(child)})
        if "skipped" in kinds and not kinds & {"failure", "error"}:
            out["skipped"] += 1
        elif not kinds & {"failure", "error", "skipped"}:
            out["passed"] += 1
    return out


ANSI = re.compile(r"(\x1b|#x1B)\[[0-9;]*m")  # junit XML writes ESC as "#x1B"
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Timeout)\b.*")


def _failure_line(element):
    """The line that says what went wrong: the last ``SomeError: ...`` line of the report
    (nbval's carry the cell's colored traceback; pytest cuts ``message`` short)."""
    for text in (element.text, element.get("message")):
        lines = [ANSI.sub("", ln).strip() for ln in (text or "").splitlines()]
        found = [ln for ln in lines if EXCEPTION_LINE.match(ln)]
        if found:
            return found[-1][:400]
    lines = [ln for ln in ANSI.sub("", element.get("message") or element.text or "").splitlines()
             if ln.strip()]
    return (lines[-1].strip() if lines else "")[:400]


def pytest_result(task):
    """A step of pytest processes' counts, from its junit XML (or why there is none)."""
    if task.not_run:
        return {"status": "not run", "passed": 0, "failed": 1, "errors": 0, "skipped": 0,
                "seconds": 0.0, "failures": [{"test": task.name, "kind": "failed",
                                              "message": task.not_run}]}
    xml = Path(task.extra["junit"])
    if task.timed_out or not xml.is_file():
        why = (f"stopped after {task.seconds:.0f} s (wall timeout)" if task.timed_out
               else f"exit {task.returncode}, no report: {task.log_tail(1)[:300]}")
        return {"status": "timed out" if task.timed_out else "failed", "passed": 0,
                "failed": 1, "errors": 0, "skipped": 0, "seconds": round(task.seconds, 1),
                "failures": [{"test": task.name, "kind": "failed", "message": why}]}
    got = parse_junit(xml)
    # pytest exits 5 when nothing was collected: not a failure of the course
    bad = got["failed"] or got["errors"] or task.returncode not in (0, 5)
    if task.returncode not in (0, 1, 5) and not got["failures"]:
        got["failures"].append({"test": task.name, "kind": "errors",
                                "message": f"pytest exit {task.returncode}: "
                                           f"{task.log_tail(1)[:300]}"})
        got["errors"] += 1
    return {"status": "failed" if bad else "ok", **got, "seconds": round(task.seconds, 1)}


def select_timelines(work, dest, labs, per_lab=2):
    """Copy one or two pictures per lab from the run folder, downscaled: {lab: [files]}."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    kept, total = {}, 0
    for lab in labs:
        names = [n for n in TIMELINES.get(lab, []) if (Path(work) / n).is_file()]
        names += sorted(p.name for p in Path(work).glob(f"{lab}_*timeline*.png")
                        if p.name not in names)
        for name in names[:per_lab]:
            dest.mkdir(parents=True, exist_ok=True)
            size = _small_png(Path(work) / name, dest / name)
            if size is None or total + size > MAX_TIMELINE_BYTES:
                (dest / name).unlink(missing_ok=True)
                continue
            total += size
            kept.setdefault(lab, []).append(f"timelines/{name}")
    return kept


def _small_png(src, dst):
    try:
        from PIL import Image

        with Image.open(src) as im:
            if im.width > MAX_PNG_PX:
                im = im.resize((MAX_PNG_PX, round(im.height * MAX_PNG_PX / im.width)))
            im.save(dst, optimize=True)
    except Exception:  # noqa: BLE001 - no Pillow, or a picture it cannot read: copy as is
        shutil.copyfile(src, dst)
    size = dst.stat().st_size
    return size if size <= MAX_PNG_BYTES else None


# -- the summary ----------------------------------------------------------------------------

def lab_entries(summary):
    """{lab: {"notebook", "status", "seconds", "figures", "timelines"}} for every lab 00-08."""
    labs = {}
    for lab in LABS:
        nb = summary.get("notebooks", {}).get(lab, {})
        figures = {}
        for bench in summary.get("benchmarks", {}).values():
            figures.update({k: v for k, v in bench.get("figures", {}).items()
                            if FIGURES[k].lab == lab})
        labs[lab] = {"notebook": nb.get("notebook"), "status": nb.get("status", "not run"),
                     "seconds": nb.get("seconds"), "figures": figures,
                     "timelines": summary.get("timelines", {}).get(lab, [])}
    return labs


def readme_row(s):
    """The README's "Where this was tested" row: date, machine, GPU, torch, notebooks,
    nbval, key ratios."""
    m = s["machine"]
    nbs = s.get("notebooks", {})
    ok = sum(v["status"] == "ok" for v in nbs.values())
    failed = [k for k, v in nbs.items() if v["status"] != "ok"]
    notebooks = (f"{ok}/{len(nbs)}" + (f" (failed: {', '.join(failed)})" if failed else "")
                 if nbs else "not run")
    nbval = s.get("nbval") or {}
    bad = nbval.get("failed", 0) + nbval.get("errors", 0)
    nbval_text = (f"{nbval.get('passed', 0)} passed, {bad} failed"
                  + (" (stopped early)" if nbval.get("stopped_early") else "")
                  if nbval else "not run")
    f = {}
    for bench in s.get("benchmarks", {}).values():
        f.update(bench.get("figures", {}))
    parts = []
    if "cp_zigzag_over_dense" in f:
        torch_cp = f.get("cp_zigzag_over_torch")
        parts.append(f"ring attention / torch CP "
                     f"{'n/a' if torch_cp is None else f'{torch_cp:.2f}'}"
                     f", / dense {f['cp_zigzag_over_dense']:.2f}")
    if "ddp_ours_over_torch" in f:
        parts.append(f"DDP / torch {f['ddp_ours_over_torch']:.2f}")
    if "fsdp_min_over_fsdp2" in f:
        parts.append(f"FSDP / FSDP2 {f['fsdp_min_over_fsdp2']:.2f}-{f['fsdp_max_over_fsdp2']:.2f}")
    if "ckpt_save_over_dcp" in f:
        parts.append(f"ckpt / DCP save {f['ckpt_save_over_dcp']:.2f} load "
                     f"{f['ckpt_load_over_dcp']:.2f}, async blocked {f['ckpt_async_blocked']:.0%}")
    if "ep_ours_over_dense" in f:
        parts.append(f"EP / dense {f['ep_ours_over_dense']:.2f}")
    if "launch_cold_s" in f:
        parts.append(f"launch 4 ranks {f['launch_cold_s']:.2f} s cold, "
                     f"{f['launch_warm_ms']:.1f} ms warm")
    torch_v = m["torch"] + (f", NCCL {m['nccl']}" if m.get("nccl") else "")
    return (f"| {s['date']} | {m['label']} | {m.get('gpu') or 'none (CPU)'} | {torch_v} | "
            f"{notebooks} | {nbval_text} | {'; '.join(parts) or '-'} |")


def _s(x):
    return None if x is None else round(x, 1)


def report(s, out):
    lines = ["", f"gpu-check on {s['machine']['label']} ({s['total_seconds']:.0f} s):"]
    for k, v in s.get("notebooks", {}).items():
        lines.append(f"  notebook {v['notebook']:<28} {v['status']:<7} {v['seconds']:>7.1f} s"
                     + (f"  {v['error']}" if v["error"] else ""))
    for step in ("nbval", "tests_gpu"):
        v = s.get(step)
        if v:
            lines.append(f"  {step:<9} {v['status']}: {v['passed']} passed, {v['failed']} failed, "
                         f"{v['errors']} errors, {v['skipped']} skipped ({v['seconds']:.0f} s)")
            lines += [f"    {f['test']}: {f['message'][:200]}" for f in v["failures"][:10]]
    for k, v in s.get("benchmarks", {}).items():
        figs = ", ".join(f"{n} {x:g}" for n, x in v.get("figures", {}).items())
        lines.append(f"  bench {k:<11} {v['status']} ({v['seconds']:.0f} s) "
                     f"{figs or v.get('error') or ''}")
    lines.append(f"summary: {out / 'summary.json'}")
    lines.append("README row (Where this was tested):")
    lines.append(s["readme_row"])
    lines.append("OK" if s["ok"] else "FAILED: " + ", ".join(s["failed"]))
    return "\n".join(lines)
