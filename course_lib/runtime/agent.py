"""torchrun with its ranks forked from the launcher: how a CPU job starts in seconds.

    python course_lib/runtime/agent.py --nproc-per-node=4 --max-restarts=0 JOB_DIR

``torchrun`` starts every rank as a new interpreter, and each imports torch
again. On a 2-core laptop ``import torch`` costs about 2 s of CPU, so a 4-rank
job spends most of its start (7 s measured here) in four copies of it, two at
a time. This module is torchrun all the same: torchrun's own argument parser
and configuration (``torch.distributed.run``), its c10d rendezvous on a free
port (``--standalone``), its elastic agent, its environment for each rank
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
its failure handling (``--max-restarts=0``: a failed rank ends the job). The one
difference: the agent is handed the rank's function
(:func:`course_lib.runtime.worker.main`) and the ranks are forked by a fork
server that imported torch while the agent did, so they start with torch
already imported: the same 4 ranks are up in about 3 s.

Only for CPU (gloo) jobs: a process that forks must not have touched CUDA, so
NCCL jobs start their ranks as plain torchrun does, and so does every script
(:func:`~course_lib.runtime.launcher.run_script`: a script owns its interpreter).
"""
from __future__ import annotations

import multiprocessing
import sys
import uuid
from multiprocessing import forkserver
from pathlib import Path


if __name__ == "__main__":
    # Run as a script, not with -m: importing the course_lib package first would import
    # torch before the fork server is started, and the two imports would run one after
    # the other instead of side by side. Its own folder is not a place to import from.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != here]


def main(argv=None):
    # The ranks are forked by a fork server: a process of its own, started here before
    # anything else, that imports torch (and the worker) while this one does, and then
    # forks each rank from that state. Not from this process: the agent runs threads
    # (its rendezvous store's), and a fork taken while one of them holds a lock hands the
    # rank a lock nobody will release (seen here: ranks stuck in init_process_group).
    multiprocessing.set_forkserver_preload(["course_lib.runtime.worker",
                                            "torch.distributed.elastic.multiprocessing.api"])
    forkserver.ensure_running()

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from course_lib.runtime import procs, worker

    *options, job_dir = sys.argv[1:] if argv is None else argv
    # torchrun's parser wants a program to run: the rank function stands in for it
    args = parse_args([*options, "--start-method=forkserver", "course_lib.runtime.worker"])
    # what torchrun does with --standalone: a c10d rendezvous on a free local port
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", uuid.uuid4().hex
    config, _, _ = config_from_args(args)
    try:
        elastic_launch(config, entrypoint=worker.main)(job_dir)
    finally:
        # every rank has ended here; the notebook that started the job removes its folder,
        # unless it is gone (a killed kernel): then the last process of the job does
        if not procs.launcher_alive(Path(job_dir)):
            procs.remove_folder(job_dir)


if __name__ == "__main__":
    main()
