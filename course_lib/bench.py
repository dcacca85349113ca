"""Benchmarks, measured as ratios in one run: ``python -m course_lib.bench WHAT``.

    python -m course_lib.bench launch --nproc 4 --repeat 5   # cost of one run()
    python -m course_lib.bench collectives --nproc 4 --sizes 4K:64M --json out.json

Timings vary run to run (+-30% on a small CPU machine): the tables report
medians, and comparisons are ratios measured side by side in one job.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _trivial():
    import torch.distributed as dist

    return dist.get_rank()


def bench_launch(nproc=4, repeat=5):
    """Wall time of ``run(trivial, nproc=N)`` as the notebook sees it, in seconds."""
    from .launch import run

    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        out = run(_trivial, nproc=nproc, timeout=120)
        times.append(time.perf_counter() - started)
        assert out == list(range(nproc)), out
    return {"nproc": nproc, "repeat": repeat, "median_s": statistics.median(times),
            "min_s": min(times), "max_s": max(times), "times_s": times}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("launch", help="cost of launching one job")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
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
    ns = parser.parse_args(argv)
    if ns.what == "launch":
        result = bench_launch(ns.nproc, ns.repeat)
        print(f"run(trivial, nproc={ns.nproc}) x{ns.repeat}: median {result['median_s']:.2f} s "
              f"(min {result['min_s']:.2f}, max {result['max_s']:.2f})")
    elif ns.what == "collectives":
        from . import bench_collectives as bc
        from .launch import run

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
