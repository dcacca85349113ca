"""Planning a hybrid run on paper: the mesh (dp, tp, pp, and cp) to use, by brute force (Lab 06).

The costs of one mesh (memory per GPU, step time, MFU) are in
:mod:`course_lib.hybrid.costs`; this module enumerates the meshes that can run,
keeps those that fit, and picks the fastest. Its namespace carries the costs'
names too, so one import serves a notebook::

    from course_lib.hybrid import plan
    plan.best_mesh(OLMO["OLMo 7B"], 32, plan.Workload(), plan.H100_80GB)  # (Mesh, step_time)
    plan.plan_table()             # OLMo 1B / 7B / 70B on A100 40GB and H100 80GB
    plan.ep_table(OLMO["OLMo 1B"], plan.Mesh(dp=64), plan.Workload(), plan.H100_80GB,
                  plan.Experts(64, 2))  # a mixture of experts: memory and speed per ep
"""
from __future__ import annotations

from course_lib.hybrid.costs import (A100_40GB, GPU, GPUS, H100_80GB, IB_ALPHA_S,
                                     NVLINK_ALPHA_S, Mesh, Workload, dp_exposed, fits,
                                     memory_per_gpu, params_per_gpu, pp_messages, step_time)
from course_lib.hybrid.moe_costs import Experts, ep_table, moe_costs
from course_lib.memory.estimate import GB, OLMO
from course_lib.tp.volume import GPUS_PER_NODE, factorizations


def valid_meshes(shape, n_gpus, work, gpus_per_node=GPUS_PER_NODE, cps=(1,)):
    """Every Mesh with dp cp tp pp = n_gpus, cp one of ``cps``, that can run: tp divides
    the heads and the GPUs of a node (so every tp group stays inside one), pp at most
    N, cp divides the sequence, the global batch splits into whole microbatches.
    Ordered by cp, then pp, then tp: the simplest meshes first."""
    out = []
    for cp in sorted(cps):
        if n_gpus % cp or shape.seq_len % cp:
            continue
        for pp, tp, dp in factorizations(n_gpus // cp, 3):
            if (shape.heads % tp == 0 and gpus_per_node % tp == 0 and pp <= shape.layers
                    and work.global_batch % (dp * work.micro_batch) == 0):
                out.append(Mesh(dp=dp, tp=tp, pp=pp, cp=cp))
    return out


def best_mesh(shape, n_gpus, work, gpu, efficiency=1.0, reserve=0.1, cps=(1,)):
    """(Mesh, step_time) of the fastest valid mesh that fits, by brute force (``cps``:
    the context-parallel degrees to try; (1,): none)."""
    meshes = valid_meshes(shape, n_gpus, work, gpu.gpus_per_node, cps)
    if not meshes:
        raise ValueError(f"no mesh of {n_gpus} GPUs splits the global batch of "
                         f"{work.global_batch} into microbatches of {work.micro_batch} "
                         f"with tp inside a node and dividing {shape.heads} heads")
    fitting = [m for m in meshes if fits(shape, m, work, gpu, reserve)]
    if not fitting:
        least = min(meshes, key=lambda m: memory_per_gpu(shape, m, work)["total"])
        need = memory_per_gpu(shape, least, work)["total"] / GB
        raise ValueError(
            f"no mesh of {n_gpus} x {gpu.name} fits: the least memory per GPU is "
            f"{need:.1f} GB ({least}), over the {(1 - reserve) * gpu.memory_gb:.1f} GB "
            f"usable; try more GPUs, activation checkpointing or ZeRO-3")
    # min keeps the first of equals: valid_meshes' order, the simplest mesh
    best = min(fitting, key=lambda m: step_time(shape, m, work, gpu, efficiency)["total"])
    return best, step_time(shape, best, work, gpu, efficiency)


# GPUs per model in plan_table: 2, 8 and 32 nodes of 4 (the lecture's cluster has 144
# A100s and 384 H100s); doubled until some mesh fits, up to MAX_GPUS.
PLAN_GPUS = {"OLMo 1B": 8, "OLMo 7B": 32, "OLMo 70B": 128}
MAX_GPUS = 4096


def plan_table(gpus_by_model=None, work=None, gpus=None, efficiency=1.0, echo=True):
    """Rows (model, gpu, n_gpus, mesh, GB per GPU, step s, tokens/s, MFU) of the best
    mesh for every model and GPU; ``echo`` prints them."""
    gpus_by_model = gpus_by_model or PLAN_GPUS
    work = work or Workload()
    rows = []
    for name, start in gpus_by_model.items():
        shape = OLMO[name]
        for gpu in (gpus or GPUS).values():
            n = start
            while True:
                try:
                    mesh, t = best_mesh(shape, n, work, gpu, efficiency)
                    break
                except ValueError:
                    if 2 * n > MAX_GPUS:
                        raise
                    n *= 2
            mem = memory_per_gpu(shape, mesh, work)["total"] / GB
            tokens = work.global_batch * shape.seq_len
            rows.append((name, gpu.name, n, str(mesh), mem, t["total"], tokens / t["total"],
                         t["mfu"]))
    if echo:
        print(f"{'model':<9} {'GPU':<10} {'GPUs':>5}  {'mesh':<18} {'GB/GPU':>7} "
              f"{'step s':>7} {'tokens/s':>10} {'MFU':>5}")
        for name, g, n, mesh, mem, sec, tps, mfu in rows:
            print(f"{name:<9} {g:<10} {n:>5}  {mesh:<18} {mem:>7.1f} {sec:>7.2f} "
                  f"{tps:>10,.0f} {mfu:>5.2f}")
    return rows


__all__ = ["GPU", "H100_80GB", "A100_40GB", "GPUS", "Mesh", "Workload", "params_per_gpu",
           "memory_per_gpu", "fits", "valid_meshes", "pp_messages", "dp_exposed", "step_time",
           "best_mesh", "plan_table", "PLAN_GPUS", "NVLINK_ALPHA_S", "IB_ALPHA_S", "Experts",
           "moe_costs", "ep_table"]
