"""What one ``run()`` costs, as the notebook sees it: ``python -m course_lib.bench launch``."""
from __future__ import annotations

import statistics
import time


def _trivial():
    import torch.distributed as dist

    return dist.get_rank()


def bench_launch(nproc=4, repeat=5):
    """Wall time of ``run(trivial, nproc=N)`` as the notebook sees it, in seconds."""
    from course_lib.runtime import run

    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        out = run(_trivial, nproc=nproc, timeout=120)
        times.append(time.perf_counter() - started)
        assert out == list(range(nproc)), out
    return {"nproc": nproc, "repeat": repeat, "median_s": statistics.median(times),
            "min_s": min(times), "max_s": max(times), "times_s": times}
