"""course_lib: distributed training built from scratch, and the machinery its labs need.

    from course_lib import run
    run(lambda: torch.distributed.get_rank(), nproc=3)   # [0, 1, 2]

``%load_ext course_lib`` adds the ``%%torchrun`` cell magic.
"""
from .launch import LaunchError, LaunchTimeout, Results, run, run_cell, run_script

__all__ = ["run", "run_cell", "run_script", "Results", "LaunchError", "LaunchTimeout"]


def load_ipython_extension(ipython):
    from .magic import register

    register(ipython)
