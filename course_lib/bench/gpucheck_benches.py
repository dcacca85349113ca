"""The benchmarks ``make gpu-check`` runs (:mod:`course_lib.bench.gpucheck`): which, with
which flags on a GPU and on the CPU rehearsal, how long each should take, and the figures
(ratios, times, details) kept from the JSON each writes."""
from __future__ import annotations

GPU_BOUND = ("cp", "fsdp", "ep")
CPU_BOUND = ("ddp", "checkpoint", "launch")
BENCHES = GPU_BOUND + CPU_BOUND
# seconds each bench should take on one H100, its process and job start included (an
# estimate from the run of 2026-11-28: what the budget keeps for them)
BENCH_ESTIMATE_S = {"cp": 20, "fsdp": 30, "ep": 16, "ddp": 24, "checkpoint": 22, "launch": 10}


def bench_args(what, nproc, backend, gpu):
    """The flags of one benchmark: on a GPU those of the H100 run of 2026-11-27, on the
    CPU rehearsal smaller sizes (the benches' defaults, or near them)."""
    mem_cps = "1" if nproc == 1 else f"1,{nproc}"
    world = ["--nproc", str(nproc), "--backend", backend]
    if gpu:
        return {"cp": world + ["--seq", "8192", "--mem-cps", mem_cps],
                "ddp": world,
                "fsdp": world + ["--dim", "1024", "--layers", "8", "--batch", "16"],
                "ep": world + ["--tokens", "16384", "--dim", "1024"],
                "checkpoint": ["--nproc", "4", "--size-mb", "256"],
                "launch": ["--nproc", "4", "--repeat", "10"]}[what]
    return {"cp": world + ["--seq", "1024", "--mem-seq", "1024", "--mem-cps", mem_cps],
            "ddp": world + ["--sweep", "4,25"],
            "fsdp": world,
            "ep": world,
            "checkpoint": ["--nproc", "4", "--size-mb", "64"],
            "launch": ["--nproc", "4", "--repeat", "10"]}[what]


def bench_figures(what, r):
    """(figures, times in ms, details) from the JSON a bench wrote with --json."""
    figures, times, details = {}, {}, {}
    if what == "launch":
        figures["launch_cold_s"] = r["first_s"]
        figures["launch_warm_ms"] = r["warm"]["median_s"] * 1e3
        times = {"first": r["first_s"] * 1e3, "warm_median": r["warm"]["median_s"] * 1e3,
                 "warm_min": r["warm"]["min_s"] * 1e3, "warm_max": r["warm"]["max_s"] * 1e3}
    elif what == "cp":
        s = r["timed"]["step_s"]
        times = {k: v * 1e3 for k, v in s.items()}
        if "torch" in s:
            figures["cp_zigzag_over_torch"] = s["zigzag"] / s["torch"]
        else:
            details["torch_error"] = r["timed"].get("torch_error")
        figures["cp_zigzag_over_dense"] = s["zigzag"] / s["dense"]
        figures["cp_contiguous_over_zigzag"] = s["contiguous"] / s["zigzag"]
        details["max_diff"] = r["timed"].get("max_diff")
    elif what == "ddp":
        s = r["step_s"]
        times = {k: v * 1e3 for k, v in s.items()}
        figures["ddp_ours_over_torch"] = s["DDP (ours)"] / s["torch DDP"]
        figures["ddp_flat_over_torch"] = s["FlatDDP"] / s["torch DDP"]
        figures["ddp_naive_over_torch"] = s["NaiveDDP"] / s["torch DDP"]
        figures["ddp_overlap"] = r["overlap"]
        details["sweep_ours_over_torch"] = {cap: v["ours_s"] / v["torch_s"]
                                            for cap, v in r["sweep"].items()}
    elif what == "fsdp":
        base = r["torch FSDP2"]["step_s"]
        times = {k: v["step_s"] * 1e3 for k, v in r.items()}
        ratios = {k: v["step_s"] / base for k, v in r.items()}
        ours = [v for k, v in ratios.items() if k.startswith("FSDP")]
        figures["fsdp_full_over_fsdp2"] = ratios["FSDP full"]
        figures["fsdp_min_over_fsdp2"], figures["fsdp_max_over_fsdp2"] = min(ours), max(ours)
        details["over_fsdp2"] = ratios
        details["state_mb"] = {k: v["state_bytes"] / 2 ** 20 for k, v in r.items()}
        details["peak_mb"] = {k: v["peak_bytes"] / 2 ** 20 for k, v in r.items()}
    elif what == "ep":
        times = {k: v * 1e3 for k, v in r["step_s"].items()}
        figures["ep_ours_over_dense"] = r["ratio"]
        details["tokens_per_s"] = r["tokens_per_s"]
    elif what == "checkpoint":
        s, ld = r["save_s"], r["load_s"]
        times = {f"{k} save": v * 1e3 for k, v in s.items()}
        times.update({f"{k} load": v * 1e3 for k, v in ld.items()})
        times["async blocked"] = r["async_blocked_s"] * 1e3
        figures["ckpt_save_over_dcp"] = s["ours"] / s["dcp"]
        figures["ckpt_load_over_dcp"] = ld["ours"] / ld["dcp"]
        figures["ckpt_async_blocked"] = r["async_blocked_s"] / r["sync_save_s"]
    rounded = lambda d: {k: round(v, 4) for k, v in d.items()}  # noqa: E731
    return rounded(figures), rounded(times), details
