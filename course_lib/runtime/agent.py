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
server that is itself a fork of the agent once it has imported torch, so they
start with torch already imported, and a job imports it once: the same 4 ranks
are up in about 3 s.

Only for CPU (gloo) jobs: a process that forks must not have touched CUDA, so
NCCL jobs start their ranks as plain torchrun does, and so does every script
(:func:`~course_lib.runtime.launcher.run_script`: a script owns its interpreter).
"""
from __future__ import annotations

import inspect
import multiprocessing
import os
import socket
import sys
import uuid
from multiprocessing import connection, forkserver, resource_tracker
from pathlib import Path


if __name__ == "__main__":
    # Run as a script (the launcher names its file); its own folder is not a place to
    # import from: procs.py there would be found as a top-level module.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != here]


def main(argv=None):
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from course_lib.runtime import folders, procs, worker  # noqa: F401 - the ranks' code, once

    *options, job_dir = sys.argv[1:] if argv is None else argv
    # torchrun's parser wants a program to run: the rank function stands in for it
    args = parse_args([*options, "--start-method=forkserver", "course_lib.runtime.worker"])
    # The ranks are forked by a fork server, itself forked from this process now: torch
    # and the worker are imported, and no thread of the agent's runs yet. Not from the
    # agent later: it runs threads (its rendezvous store's), and a fork taken while one
    # of them holds a lock hands the rank a lock nobody will release (seen here: ranks
    # stuck in init_process_group).
    _fork_server_from_here(preload(int(args.nproc_per_node)))
    # what torchrun does with --standalone: a c10d rendezvous on a free local port
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", uuid.uuid4().hex
    config, _, _ = config_from_args(args)
    try:
        elastic_launch(config, entrypoint=worker.main)(job_dir)
    finally:
        # every rank has ended here; the notebook that started the job removes its folder,
        # unless it is gone (a killed kernel): then the last process of the job does
        if not folders.launcher_alive(Path(job_dir)):
            folders.remove_folder(job_dir)


def preload(nproc):
    """What the fork server imports, once, before it forks the ranks (the agent sets up
    its rendezvous meanwhile): torch._dynamo, which the first torch.optim optimizer a
    rank makes imports (Optimizer.__init__ is wrapped by torch._disable_dynamo), a
    second of CPU per rank. Only where the ranks are more than twice the cores, so that
    their copies would take longer in turns than the one preload: a 16-rank job on 2
    cores spent 10 s of its first step in them (1.4 s with the preload). With fewer
    ranks it is about even for a job that makes an optimizer, and one that makes none
    (a job of collectives) would wait a second for nothing."""
    return ["torch._dynamo"] if nproc > 2 * (os.cpu_count() or 1) else []


def _fork_server_from_here(modules):
    """Start multiprocessing's fork server as a fork of this process, so that it holds
    what this one imported: the fork server that multiprocessing starts is a new
    interpreter, which would import torch a second time (a second of CPU per job, and a
    class graded on 2 cores starts about 40 jobs). Where this Python's fork server does not
    take the arguments it is written for, the usual one is started instead."""
    server = forkserver._forkserver
    parameters = list(inspect.signature(forkserver.main).parameters)
    if parameters != ["listener_fd", "alive_r", "preload", "main_path", "sys_path"] or \
            not hasattr(server, "_forkserver_alive_fd"):
        multiprocessing.set_forkserver_preload(["course_lib.runtime.worker", *modules])
        forkserver.ensure_running()
        return
    resource_tracker.ensure_running()  # the ranks share this process's tracker
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        # the ranks hold the write end of "alive": the server ends when they all have
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(alive_w)
                forkserver.main(listener.fileno(), alive_r, modules)
            finally:
                os._exit(0)  # never this process's exit handlers: they are the agent's
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd = address, alive_w
    server._forkserver_pid = pid


if __name__ == "__main__":
    main()
