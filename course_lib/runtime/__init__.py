"""Launching real torchrun jobs from a notebook, and what every rank needs to start.

The notebook's side, top down (each module imports only those below it):

- :mod:`~course_lib.runtime.launcher`: ``run``, ``run_cell``, ``run_script``, ``shutdown``
  (and :mod:`~course_lib.runtime.magic`, the ``%%torchrun`` cell magic): a thin facade
- :mod:`~course_lib.runtime.warm`: the pool of warm jobs a kernel keeps between calls
- :mod:`~course_lib.runtime.job`: one job's whole life: start, call, fail, end
- :mod:`~course_lib.runtime.command`, :mod:`~course_lib.runtime.output`,
  :mod:`~course_lib.runtime.results`: its command line, its output, its return values
- :mod:`~course_lib.runtime.failures`: how a job failed, explained from what its ranks left
- :mod:`~course_lib.runtime.hangs`, :mod:`~course_lib.runtime.stacks`,
  :mod:`~course_lib.runtime.dumps`: a hung job, its ranks' states, their stack dumps
- :mod:`~course_lib.runtime.procs`: finding and ending every process of a job;
  :mod:`~course_lib.runtime.folders`: its folder, removed with it or swept after a dead kernel

The ranks' side: :mod:`~course_lib.runtime.worker` (what torchrun starts on each rank),
:mod:`~course_lib.runtime.rank_io` (its output, return values and watch on the kernel),
:mod:`~course_lib.runtime.isolation` (what a warm rank resets between calls),
:mod:`~course_lib.runtime.nccl_rules`. Both sides: :mod:`~course_lib.runtime.backend`
(``backend="auto"``, joining the process group), :mod:`~course_lib.runtime.device`
(``sync()``; helper threads on the rank's GPU).
"""
from course_lib.runtime.backend import (backend_for, current_device, device_mesh, enough_ranks,
                                        init_distributed, resolve_backend)
from course_lib.runtime.device import set_thread_device, sync
from course_lib.runtime.launcher import (LaunchError, LaunchTimeout, Results, run, run_cell,
                                         run_script, shutdown)

__all__ = ["run", "run_cell", "run_script", "Results", "LaunchError", "LaunchTimeout",
           "shutdown", "current_device", "device_mesh", "backend_for", "enough_ranks",
           "init_distributed", "resolve_backend", "sync", "set_thread_device"]
