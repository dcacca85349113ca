"""Hybrid parallelism: data, tensor and pipeline parallelism combined on one mesh.

- :mod:`~course_lib.hybrid.plan`: a run planned on paper: the mesh (dp, tp, pp),
  memory per GPU, step time with an alpha-beta model of every link, MFU
"""
from course_lib.hybrid.plan import (GPU, GPUS, A100_40GB, H100_80GB, Mesh, Workload, best_mesh,
                                    fits, memory_per_gpu, params_per_gpu, plan_table, step_time,
                                    valid_meshes)

__all__ = ["GPU", "GPUS", "A100_40GB", "H100_80GB", "Mesh", "Workload", "params_per_gpu",
           "memory_per_gpu", "fits", "valid_meshes", "step_time", "best_mesh", "plan_table"]
