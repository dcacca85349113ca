"""Lab 06: the parallelisms combined on one mesh, compared, and planned for real runs.

- :mod:`~course_lib.hybrid.strategies`: the course GPT trained as DP, DP x TP, DP x PP
  and DP x FSDP on a mesh of ranks, and the single-process run each must equal
- :mod:`~course_lib.hybrid.table`: the strategies measured side by side in one job
  (tokens/s, model state measured and estimated, step peak, bytes per step)
- :mod:`~course_lib.hybrid.plan`: a run planned on paper: the mesh (dp, tp, pp),
  memory per GPU, step time with an alpha-beta model of every link, MFU
"""
from course_lib.hybrid.plan import (GPU, GPUS, A100_40GB, H100_80GB, Mesh, Workload, best_mesh,
                                    fits, memory_per_gpu, params_per_gpu, plan_table, step_time,
                                    valid_meshes)

__all__ = ["GPU", "GPUS", "A100_40GB", "H100_80GB", "Mesh", "Workload", "params_per_gpu",
           "memory_per_gpu", "fits", "valid_meshes", "step_time", "best_mesh", "plan_table"]
