"""The command line and environment a job's torchrun process starts with.

Pure: both come from the job's settings (``nproc``, backend, mode, NCCL's rules,
``max_restarts``) and its folder, so they can be read and tested without
starting anything. :class:`course_lib.runtime.job.Job` starts what they say.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from course_lib.runtime import nccl_rules, procs

AGENT = Path(__file__).resolve().with_name("agent.py")
COURSE_ROOT = Path(__file__).resolve().parents[2]


def command(nproc, backend, mode, rules, max_restarts, job_dir):
    """``torchrun`` (or the forking agent) on ``nproc`` ranks of one node, each rank
    running :mod:`course_lib.runtime.worker` on ``job_dir``."""
    # --standalone: the rendezvous store binds port 0 and learns its port from
    # the kernel, so two notebooks launching at the same moment never collide.
    options = [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
               "--monitor-interval=0.1"]
    if mode != "script" and backend == "gloo" and not rules:
        # torchrun with the ranks forked from it (torch imported once): agent.py
        return [sys.executable, str(AGENT), *options, str(job_dir)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", *options,
            "-m", "course_lib.runtime.worker", str(job_dir)]


def environment(nproc, backend, rules, max_restarts, job_id, job_dir, extra=None):
    """The notebook's environment, plus what the ranks need and minus what they must not
    inherit."""
    env = dict(os.environ)
    env.pop(nccl_rules.ENV, None)
    if rules:  # course_lib.runtime.nccl_rules
        env[nccl_rules.ENV] = "1"
    env[procs.MARKER] = job_id
    env["COURSE_BACKEND"] = backend
    if backend == "gloo":
        # gloo ranks compute on the CPU (backend.current_device). Hiding the GPUs keeps
        # torch's own defaults from reaching for one the job does not own (an optimizer's
        # graph-capture check, Lightning's "auto"): on a one-GPU laptop every rank would
        # otherwise open a CUDA context of its own on the shared GPU.
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONUNBUFFERED"] = "1"
    # torchrun's and the ranks' temporary files live and die with the job folder
    env["TMPDIR"] = str(job_dir)
    # torchrun would set 1 and print a warning; share the cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # Ranks must import what the notebook imports: course_lib and the notebook's folder.
    roots = [str(COURSE_ROOT), os.getcwd()]
    if env.get("PYTHONPATH"):
        roots.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(roots)
    if max_restarts:
        # A restarted rank would otherwise meet the previous attempt's keys in the store
        # torchrun's rendezvous shares with init_process_group, and dial a dead peer's
        # port (gloo: "connectFullMesh failed ... Connection refused"; pytorch#135712):
        # with sharing off, every attempt's rank 0 hosts a store of its own.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(extra or {})
    return env
