"""torchrun with its ranks forked from the launcher: how a CPU job starts in seconds.

    python -m course_lib.runtime.agent --nproc-per-node=4 --max-restarts=0 JOB_DIR

``torchrun`` starts every rank as a new interpreter, and each imports torch
again. On a 2-core laptop ``import torch`` costs about 2 s of CPU, so a 4-rank
job spends most of its start (7 s measured here) in four copies of it, two at
a time. This module is torchrun all the same: torchrun's own argument parser
and configuration (``torch.distributed.run``), its c10d rendezvous on a free
port (``--standalone``), its elastic agent, its environment for each rank
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
its failure handling (``--max-restarts=0``: a failed rank ends the job). The one
difference: the agent is handed the rank's function
(:func:`course_lib.runtime.worker.main`) and forks the ranks from itself, so
they start with torch already imported: the same 4 ranks are up in about 2.5 s.

Only for CPU (gloo) jobs: a process that forks must not have touched CUDA, so
NCCL jobs start their ranks as plain torchrun does, and so does every script
(:func:`~course_lib.runtime.launcher.run_script`: a script owns its interpreter).
"""
from __future__ import annotations

import sys
import uuid
from pathlib import Path

from course_lib.runtime import procs


def main(argv=None):
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from course_lib.runtime import worker

    *options, job_dir = sys.argv[1:] if argv is None else argv
    # torchrun's parser wants a program to run: the rank function stands in for it
    args = parse_args([*options, "--start-method=fork", "course_lib.runtime.worker"])
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
