"""course_lib: distributed training built from scratch, and the machinery its labs need.

    from course_lib import run, sync
    run(lambda: torch.distributed.get_rank(), nproc=3)   # [0, 1, 2]
    sync()   # on a rank: wait for its GPU before reading a clock (no-op on CPU)

The package is laid out by layer; a lower layer never imports a higher one:

    runtime/      launching torchrun jobs from a notebook (the only layer the notebook process needs)
    comm, mesh    counted point-to-point on any process group; ParallelDims on a DeviceMesh
    trace/        per-rank spans, merged timelines, metrics, Gantt charts
    collectives/  Labs 00-01: p2p patterns, broadcast/reduce, ring collectives, cost model
    ddp/          Lab 02: naive, flat and bucketed data parallelism
    memory/       Lab 03: the lecture's memory formulas, and memory measured
    fsdp/         Lab 03: ZeRO-1, FSDP units (the library's and the one-page version)
    pipeline/     Lab 04: schedules as data, the partitioner, the stage executor
    tp/           Lab 05: f and g, column/row-parallel layers, a parallel block
    hybrid/       Lab 06: the four above combined on a mesh, compared, and planned for OLMo
    models, data  the course's models and data
    grading/      checks, the lab generator, the gradebook, the papermill runner
    bench/        ``python -m course_lib.bench <what>``

``%load_ext course_lib`` adds the ``%%torchrun`` cell magic.
"""
from course_lib.runtime import (LaunchError, LaunchTimeout, Results, backend_for, enough_ranks,
                                run, run_cell, run_script, shutdown, sync)

__all__ = ["run", "run_cell", "run_script", "shutdown", "Results", "LaunchError",
           "LaunchTimeout", "sync", "backend_for", "enough_ranks"]


def load_ipython_extension(ipython):
    from course_lib.runtime.magic import register

    register(ipython)
