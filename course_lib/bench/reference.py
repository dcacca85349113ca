"""What a GPU showed, beside what the student's CPU shows: ``reference/<gpu>/summary.json``.

    from course_lib.bench import reference
    reference.load("h100")["machine"]["gpu"]               # 'NVIDIA H100 80GB HBM3'
    print(reference.line("07", "cp_zigzag_over_torch", mine=3.1))
    print(reference.lines("08"))                           # every figure of Lab 08

The summaries are written by ``make gpu-check`` (:mod:`course_lib.bench.gpucheck`), one
folder per GPU. They are found in the source checkout (``<repo>/reference/``, also for
an editable install), in an installed package's data (``<prefix>/share/course_lib/reference/``,
see pyproject's data-files), or in ``$COURSE_LIB_REFERENCE``.
"""
from __future__ import annotations

import json
import os
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Figure:
    lab: str
    bench: str  # python -m course_lib.bench <bench>
    label: str
    unit: str = "x"  # "x": a ratio ours / theirs (< 1: ours is faster), "%", "s", "ms"


# Every figure a gpu-check summary carries per lab (labs 01, 04, 05 and 06 have no
# world-1 benchmark: a ring, a pipeline and a TP split need >= 2 ranks; their entry is
# the notebook's run).
FIGURES = {
    "launch_cold_s": Figure("00", "launch", "cold launch of 4 ranks (first run() call)", "s"),
    "launch_warm_ms": Figure("00", "launch", "a warm run() call of 4 ranks, median", "ms"),
    "ddp_ours_over_torch": Figure("02", "ddp", "step time, our bucketed DDP / torch DDP"),
    "ddp_flat_over_torch": Figure("02", "ddp", "step time, FlatDDP / torch DDP"),
    "ddp_naive_over_torch": Figure("02", "ddp", "step time, NaiveDDP / torch DDP"),
    "ddp_overlap": Figure("02", "ddp", "overlap of our bucket all-reduces with backward", "%"),
    "fsdp_full_over_fsdp2": Figure("03", "fsdp", "step time, our FSDP (full sharding) / "
                                                 "torch FSDP2"),
    "fsdp_min_over_fsdp2": Figure("03", "fsdp", "step time, our fastest FSDP variant / "
                                                "torch FSDP2"),
    "fsdp_max_over_fsdp2": Figure("03", "fsdp", "step time, our slowest FSDP variant / "
                                                "torch FSDP2"),
    "cp_zigzag_over_torch": Figure("07", "cp", "step time, ring attention (zigzag) / torch "
                                         "context_parallel"),
    "cp_zigzag_over_dense": Figure("07", "cp", "step time, ring attention (zigzag) / dense SDPA"),
    "cp_contiguous_over_zigzag": Figure("07", "cp", "step time, contiguous layout / zigzag"),
    "ep_ours_over_dense": Figure("07", "ep", "tokens/s, expert-parallel MoE layer / dense layer"),
    "ckpt_save_over_dcp": Figure("08", "checkpoint", "sharded save, ours / torch DCP"),
    "ckpt_load_over_dcp": Figure("08", "checkpoint", "sharded load, ours / torch DCP"),
    "ckpt_async_blocked": Figure("08", "checkpoint", "async save: time the loop blocked, "
                                                     "share of a synchronous save", "%"),
}
LABS = tuple(f"{n:02d}" for n in range(9))


def roots():
    """Folders searched for ``<name>/summary.json``, first match wins."""
    found = []
    if os.environ.get("COURSE_LIB_REFERENCE"):
        found.append(Path(os.environ["COURSE_LIB_REFERENCE"]))
    found.append(Path(__file__).resolve().parents[2] / "reference")  # the source checkout
    prefixes = [sysconfig.get_path("data"), sys.prefix, getattr(site, "USER_BASE", None)]
    for prefix in prefixes:
        if prefix:
            found.append(Path(prefix) / "share" / "course_lib" / "reference")
    return list(dict.fromkeys(found))


def path(name="h100"):
    """The folder of one reference (``h100``, ``cpu-rehearsal``, ...)."""
    for root in roots():
        if (root / name / "summary.json").is_file():
            return root / name
    raise FileNotFoundError(f"no reference {name!r} in " + ", ".join(map(str, roots())))


def available():
    """Names of the references that can be loaded."""
    names = set()
    for root in roots():
        if root.is_dir():
            names.update(p.parent.name for p in root.glob("*/summary.json"))
    return sorted(names)


def load(name="h100"):
    """The summary of one reference as a dict (schema: :mod:`course_lib.bench.gpucheck`)."""
    return json.loads((path(name) / "summary.json").read_text())


def value(name, figure, ref=None):
    """One figure of a reference, or None where it was not measured."""
    ref = ref if ref is not None else load(name)
    lab = FIGURES[figure].lab
    return ref.get("labs", {}).get(lab, {}).get("figures", {}).get(figure)


def fmt(figure, v):
    if v is None:
        return "n/a"
    unit = FIGURES[figure].unit
    if unit == "%":
        return f"{v:.0%}"
    if unit == "x":
        return f"{v:.2f}"
    return f"{v:.2f} {unit}" if unit == "s" else f"{v:.1f} {unit}"


def line(lab, figure, mine=None, name="h100"):
    """One line: a figure of ``lab`` on the student's machine (``mine``) beside the
    reference GPU's, e.g. ``line("07", "cp_zigzag_over_torch", mine=3.1)``."""
    if figure not in FIGURES:
        raise KeyError(f"unknown figure {figure!r}; figures: {', '.join(FIGURES)}")
    fig = FIGURES[figure]
    if fig.lab != lab:
        raise KeyError(f"{figure} belongs to Lab {fig.lab}, not Lab {lab}")
    try:
        ref = load(name)
    except FileNotFoundError:
        ref = None
    head = f"Lab {lab}, {fig.label}: "
    yours = f"yours {fmt(figure, mine)} (this machine)" if mine is not None else ""
    if ref is None:
        return head + (yours + "; " if yours else "") + f"no reference {name!r} found"
    m = ref.get("machine", {})
    command = ref.get("benchmarks", {}).get(fig.bench, {}).get("command") or fig.bench
    where = (f"{m.get('gpu') or 'CPU only'}: {fmt(figure, value(name, figure, ref))} "
             f"({command.replace('python -m course_lib.bench ', '')}; {ref.get('date', '?')}, "
             f"torch {m.get('torch', '?')})")
    return head + (yours + "; " if yours else "") + where


def notebook_line(lab, name="h100"):
    """How the lab's notebook ran on the reference machine (NPROC, backend, seconds)."""
    ref = load(name)
    nb, st, m = ref["labs"][lab], ref.get("settings", {}), ref.get("machine", {})
    if not nb.get("notebook"):
        return f"Lab {lab} on {m.get('gpu') or 'CPU only'}: the notebook did not run"
    error = ref.get("notebooks", {}).get(lab, {}).get("error")
    why = f": {error[:120]}" if nb["status"] != "ok" and error else ""
    return (f"Lab {lab} on {m.get('gpu') or 'CPU only'}: {nb['notebook']} {nb['status']} in "
            f"{nb['seconds']:.0f} s (NPROC={st.get('nproc')}, {st.get('backend')}, quick; "
            f"{ref.get('date', '?')}){why}")


def lines(lab, mine=None, name="h100"):
    """The lab's notebook on the reference machine, then every figure of the lab, one line
    each (``mine``: {figure: the student's value})."""
    mine = mine or {}
    out = [notebook_line(lab, name)]
    out += [line(lab, f, mine.get(f), name) for f, fig in FIGURES.items() if fig.lab == lab]
    return "\n".join(out)
