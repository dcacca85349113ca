"""Benchmarks, measured as ratios in one run: ``python -m course_lib.bench WHAT``.

    python -m course_lib.bench launch --nproc 4 --repeat 10  # first and warm run() calls
    python -m course_lib.bench collectives --nproc 4 --sizes 4K:64M --json out.json
    python -m course_lib.bench ddp --nproc 2 --bucket-mb 25 --sweep 1,4,16,64
    python -m course_lib.bench ddp --nproc 1 --backend nccl --model gpt2-small --sweep ""
    python -m course_lib.bench fsdp --nproc 2 --dim 128 --layers 4
    python -m course_lib.bench pipeline --nproc 2 --json out.json
    python -m course_lib.bench tp --nproc 2 --dim 256 --heads 8   # ours vs torch DTensor vs t=1
    python -m course_lib.bench checkpoint --nproc 4 --size-mb 64  # ours vs DCP, async save
    python -m course_lib.bench ep --nproc 2 --tokens 4096 --experts 8 --top-k 2  # vs dense MoE
    python -m course_lib.bench cp --nproc 2 --seq 1024 --dim 256 --heads 8  # ring vs torch CP vs dense

Timings vary run to run (+-30% on a small CPU machine): the tables report
medians, and comparisons are ratios measured side by side in one job.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("launch", help="cost of launching one job")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeat", type=int, default=10, help="warm calls after the first")
    p.add_argument("--json", default=None)
    p = sub.add_parser("collectives", help="ours vs torch's collectives, nccl-tests style")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--sizes", default="4K:64M", help="MIN:MAX bytes, e.g. 4K:64M")
    p.add_argument("--factor", type=int, default=4, help="size step (nccl-tests -f)")
    p.add_argument("--ops", default="all_reduce,reduce_scatter,all_gather,broadcast",
                   help="comma-separated, from: all_reduce, naive_all_reduce, "
                        "reduce_scatter, all_gather, broadcast, pipelined_broadcast")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--target-s", type=float, default=0.3, help="seconds per measurement")
    p.add_argument("--json", default=None)
    p = sub.add_parser("ddp", help="our DDP variants vs torch DDP, and a bucket sweep")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--sweep", default="1,4,16,64",
                   help="bucket sizes (MB) to sweep ('' for no sweep)")
    p.add_argument("--model", default="mlp", choices=("mlp", "gpt2-small"),
                   help="mlp: --width x --depth Linear+ReLU, MSE; gpt2-small: the course's "
                        "GPT at GPT-2 small's shape (vocab 50257, untied head: 163M)")
    p.add_argument("--width", type=int, default=1024, help="mlp only")
    p.add_argument("--depth", type=int, default=8, help="mlp only")
    p.add_argument("--batch", type=int, default=None, help="rows (mlp, 64) or sequences "
                                                           "(gpt2-small, 8) per rank")
    p.add_argument("--seq", type=int, default=None, help="gpt2-small: tokens per sequence "
                                                         "(1024)")
    p.add_argument("--steps", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p = sub.add_parser("fsdp", help="DDP, ZeRO-1, ZeRO-2, our FSDP and torch FSDP2: time and memory")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p = sub.add_parser("tp", help="a tensor-parallel block: ours vs torch DTensor vs t=1")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    p = sub.add_parser("cp", help="causal attention: ring attention vs torch context_parallel "
                                  "vs dense; per-rank work and activation memory")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256, help="heads x head_dim")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mem-seq", type=int, default=4096, help="sequence of the memory rows")
    p.add_argument("--mem-cps", default="1,2,4", help="context-parallel sizes of the memory rows")
    p.add_argument("--json", default=None)
    p = sub.add_parser("ep", help="an expert-parallel MoE layer vs the whole layer on every rank")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the batch (all ranks)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=None, help="expert hidden width (default 4 dim)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--steps", type=int, default=2, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    p = sub.add_parser("checkpoint", help="sharded save and load: ours vs torch DCP, async")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--size-mb", type=float, default=64, help="the whole state, all ranks")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p = sub.add_parser("pipeline", help="naive MP, GPipe, 1F1B: ours vs torch.distributed.pipelining")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=2, help="Linear+ReLU layers per stage")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--m", type=int, default=None, help="microbatches (default 2 * nproc)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--t-f", type=float, default=0.01, help="fixed-time stages: forward seconds")
    p.add_argument("--t-b", type=float, default=0.02, help="fixed-time stages: backward seconds")
    p.add_argument("--json", default=None)
    ns = parser.parse_args(argv)
    if ns.what == "pipeline":
        from course_lib.bench import pipeline as bp
        from course_lib.runtime.launcher import run

        if ns.nproc < 2:
            parser.error("a pipeline needs --nproc >= 2 (one stage per rank)")
        real = run(bp.measure_real, width=ns.width, depth=ns.depth, batch=ns.batch, m=ns.m,
                   rounds=ns.rounds, nproc=ns.nproc, backend=ns.backend, timeout=3600)[0]
        print(bp.format_real(real, ns.nproc))
        bubbles = bp.bubble_table(ns.nproc, ns.backend, ns.t_f, ns.t_b)
        print(bp.format_bubbles(bubbles, ns.nproc, ns.t_f, ns.t_b))
        result = {"nproc": ns.nproc, "real": real, "bubbles": bubbles}
    if ns.what == "cp":
        from course_lib.bench import cp as bcp
        from course_lib.runtime.launcher import run

        if ns.dim % ns.heads:
            parser.error(f"--dim {ns.dim} must be divisible by --heads {ns.heads}")
        shape = dict(batch=ns.batch, heads=ns.heads, seq=ns.seq, head_dim=ns.dim // ns.heads)
        timed = run(bcp.measure, steps=ns.steps, rounds=ns.rounds, nproc=ns.nproc,
                    backend=ns.backend, timeout=3600, **shape)[0]
        work = bcp.imbalance(nproc=ns.nproc, backend=ns.backend, **shape)
        cps = [int(c) for c in ns.mem_cps.split(",") if c.strip()]
        mem = bcp.memory(cps, batch=ns.batch, seq=ns.mem_seq, dim=ns.dim, heads=ns.heads,
                         backend=ns.backend)
        print(bcp.format_table(timed, ns.nproc, work, mem))
        result = {"timed": timed, "imbalance": work, "memory": mem}
    if ns.what == "checkpoint":
        from course_lib.bench import checkpoint as bk
        from course_lib.runtime.launcher import run

        result = run(bk.measure, size_mb=ns.size_mb, tensors=ns.tensors, rounds=ns.rounds,
                     nproc=ns.nproc, backend="gloo", timeout=3600)[0]
        print(bk.format_table(result))
    if ns.what == "ep":
        from course_lib.bench import ep as be
        from course_lib.runtime.launcher import run

        if ns.experts % ns.nproc:
            parser.error(f"{ns.experts} experts do not split over --nproc {ns.nproc}")
        result = run(be.measure, tokens=ns.tokens, dim=ns.dim, experts=ns.experts,
                     top_k=ns.top_k, ffn=ns.ffn, capacity_factor=ns.capacity_factor,
                     steps=ns.steps, rounds=ns.rounds, nproc=ns.nproc, backend=ns.backend,
                     timeout=3600)[0]
        print(be.format_table(result, ns.nproc))
    if ns.what == "tp":
        from course_lib.bench import tp as bt
        from course_lib.runtime.launcher import run

        cfg = bt.config(dim=ns.dim, heads=ns.heads, seq_len=ns.seq)
        result = run(bt.measure, cfg, batch=ns.batch, steps=ns.steps, rounds=ns.rounds,
                     nproc=ns.nproc, backend=ns.backend, timeout=3600)[0]
        print(bt.format_table(result, ns.nproc))
    if ns.what == "fsdp":
        from course_lib.bench import fsdp as bf
        from course_lib.runtime.launcher import run

        cfg = bf.config(dim=ns.dim, layers=ns.layers)
        result = run(bf.measure, cfg, batch=ns.batch, rounds=ns.rounds, nproc=ns.nproc,
                     backend=ns.backend, timeout=3600)[0]
        print(bf.format_table(result, ns.nproc))
    elif ns.what == "ddp":
        from course_lib.bench import ddp as bd
        from course_lib.bench import ddp_hooks as bdh
        from course_lib.runtime.launcher import run
        from course_lib.trace.metrics import overlap_fraction

        if ns.model == "mlp" and ns.seq is not None:
            parser.error("--seq is for --model gpt2-small")
        batch = ns.batch if ns.batch is not None else (64 if ns.model == "mlp" else 8)
        shape = dict(width=ns.width, depth=ns.depth, batch=batch, model=ns.model, seq=ns.seq)
        timing = dict(steps=ns.steps, rounds=ns.rounds)
        times = run(bd.measure, bucket_mb=ns.bucket_mb, nproc=ns.nproc, backend=ns.backend,
                    timeout=3600, **shape, **timing)[0]
        cost = run(bdh.hook_cost, bucket_mb=ns.bucket_mb, nproc=ns.nproc, backend=ns.backend,
                   timeout=3600, **shape, **timing)[0]
        traced = run(bd.traced_overlap, bucket_mb=ns.bucket_mb, nproc=ns.nproc,
                     backend=ns.backend, timeout=600, **shape)
        caps = [float(c) for c in ns.sweep.split(",") if c.strip()]
        sweep = run(bd.bucket_sweep, caps, nproc=ns.nproc, backend=ns.backend, timeout=3600,
                    **shape, **timing)[0] if caps else {}
        overlap = overlap_fraction(traced.trace, "comm", "compute")
        print(f"model: {bd.describe(ns.model, ns.width, ns.depth, batch, ns.seq)}")
        print(bd.format_tables(times, sweep, overlap, ns.nproc, ns.bucket_mb))
        print(bdh.format_hook_cost(cost))
        result = {"model": ns.model, "batch": batch, "step_s": times, "overlap": overlap,
                  "buckets": traced[0], "hook_cost": cost,
                  "sweep": {str(k): {"ours_s": v[0], "torch_s": v[1]} for k, v in sweep.items()}}
    elif ns.what == "launch":
        from course_lib.bench.launch import bench_launch, format_launch

        result = bench_launch(ns.nproc, ns.repeat)
        print(format_launch(result))
    elif ns.what == "collectives":
        from course_lib.bench import collectives as bc
        from course_lib.runtime.launcher import run

        ops = [o.strip() for o in ns.ops.split(",") if o.strip()]
        unknown = sorted(set(ops) - set(bc.OPS))
        if unknown:
            parser.error(f"unknown ops {unknown}; choose from {list(bc.OPS)}")
        sizes = bc.size_range(ns.sizes, ns.factor)
        result = run(bc.measure, sizes, ops, ns.warmup, ns.target_s, nproc=ns.nproc,
                     backend=ns.backend, timeout=3600)[0]
        print(f"collectives on {ns.nproc} ranks:")
        print(bc.format_table(result))
    if getattr(ns, "json", None):
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
