"""What one ``run()`` costs, as the notebook sees it: ``python -m course_lib.bench launch``.

Reports the first call (a fresh torchrun job: start-up, ``import torch`` in
every rank, rendezvous) apart from the warm calls that follow it (the ranks
already up, :mod:`course_lib.runtime.warm`)."""
from __future__ import annotations

import statistics
import time


def _trivial():
    import torch.distributed as dist

    return dist.get_rank()


def _summary(times):
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "times_s": times}


def bench_launch(nproc=4, repeat=10):
    """Wall time of ``run(trivial, nproc=N)``: the first call of a fresh job, then
    ``repeat`` warm calls, in seconds."""
    from course_lib.runtime import run, shutdown

    def timed():
        started = time.perf_counter()
        out = run(_trivial, nproc=nproc, timeout=120)
        elapsed = time.perf_counter() - started
        assert out == list(range(nproc)), out
        return elapsed

    shutdown()  # the first call must start a job
    first = timed()
    warm = [timed() for _ in range(repeat)]
    shutdown()
    return {"nproc": nproc, "repeat": repeat, "first_s": first, "warm": _summary(warm)}


def format_launch(result):
    w = result["warm"]
    return (f"run(trivial, nproc={result['nproc']}): first call {result['first_s']:.2f} s; "
            f"{result['repeat']} warm calls: median {w['median_s'] * 1e3:.1f} ms "
            f"(min {w['min_s'] * 1e3:.1f}, max {w['max_s'] * 1e3:.1f})")
