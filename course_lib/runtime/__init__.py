"""Launching real torchrun jobs from a notebook, and what every rank needs to start.

- :mod:`~course_lib.runtime.launcher`: ``run``, ``run_cell``, ``run_script``, ``shutdown`` (the notebook side)
- :mod:`~course_lib.runtime.job`: one torchrun process, its output and its stacks
- :mod:`~course_lib.runtime.stacks`: a hung rank's stack, trimmed to the student's code
- :mod:`~course_lib.runtime.hangs`: what kind of hang all ranks' stacks show, with a hint
- :mod:`~course_lib.runtime.warm`: the warm job a kernel keeps between calls
- :mod:`~course_lib.runtime.isolation`: what a warm rank resets between calls
- :mod:`~course_lib.runtime.worker`: what torchrun starts on each rank
- :mod:`~course_lib.runtime.procs`: finding and ending every process of a job
- :mod:`~course_lib.runtime.backend`: ``backend="auto"``, joining the process group
- :mod:`~course_lib.runtime.device`: ``sync()``; helper threads on the rank's GPU
- :mod:`~course_lib.runtime.magic`: the ``%%torchrun`` cell magic
"""
from course_lib.runtime.backend import (backend_for, current_device, device_mesh, enough_ranks,
                                        init_distributed, resolve_backend)
from course_lib.runtime.device import set_thread_device, sync
from course_lib.runtime.launcher import (LaunchError, LaunchTimeout, Results, run, run_cell,
                                         run_script, shutdown)

__all__ = ["run", "run_cell", "run_script", "Results", "LaunchError", "LaunchTimeout",
           "shutdown", "current_device", "device_mesh", "backend_for", "enough_ranks", "init_distributed",
           "resolve_backend", "sync", "set_thread_device"]
