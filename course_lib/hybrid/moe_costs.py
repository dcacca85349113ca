"""When expert parallelism pays, on paper (Lab 06, with Lab 07's layers).

A mixture-of-experts model here is a dense shape (:mod:`course_lib.hybrid.costs`'s
notation: s, b, h, N layers, P) whose every MLP becomes E experts of the same size,
8 h^2 + 5 h each (a 4h-wide MLP), a token running through k of them. On a mesh
(dp, tp, pp, cp), ep splits the experts over ep of the dp ranks (ep divides dp and E),
as :mod:`course_lib.hybrid.experts` does at ep = dp:

- **memory**: a GPU holds its stage's N/pp layers of E/ep experts, each 1/tp of it
  (Megatron splits an expert as it splits an MLP), their model state sharded by ZeRO
  over the dp c / ep ranks that hold the same experts; the rest as the dense mesh;
- **compute**: the dense step's, plus (k - 1) more MLPs per token per layer: the active
  parameters grow by (k - 1) N (8 h^2 + 5 h);
- **a2a**: per layer per microbatch, two all-to-alls forward (the tokens out to their
  experts, the results back) and two backward (two more with recompute). Routing is taken
  as even: each of a GPU's b (s/c) k token copies, h bf16 values split over tp, goes to
  each of the ep ranks with chance 1/ep. An ep group is ep dp ranks, one every c tp GPUs
  (tp fastest, then cp, then dp); the copies for peers in the same node go over NVLink (a
  board's pair link to each peer at once, a switch's whole bandwidth shared), the others
  over InfiniBand, both at once; an all-to-all posts every send and receive together (as
  NCCL's does), so it pays one latency, and lasts as long as its slower link, on the
  GPU whose group is placed worst. On the critical path: the experts wait for their
  tokens;
- **expert_sync**: the dense mesh's dp traffic is split in two: the shared weights'
  gradients over the dp c ranks holding them, the held experts' over the dp c / ep
  ranks holding those (at ep = 1 the same ranks: one traffic), each charged as
  :func:`costs.dp_exposed` charges it (the two replace the dense ``dp_comm``);
  ``expert_sync`` is what the experts add.

Left out: the load's imbalance (an expert given more than its share of tokens makes every
rank wait; capacity bounds it), ZeRO-3's gathered layer of experts, and the k - 1 more
expert activations a token leaves.

At ep = 1 every GPU holds all E experts: the replicated MoE. ::

    moe_costs(OLMO["OLMo 1B"], Mesh(dp=64), Workload(), H100_80GB, Experts(64, 2), ep=8)
    ep_table(OLMO["OLMo 1B"], Mesh(dp=64), Workload(), H100_80GB, Experts(64, 2))
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.hybrid.costs import _link, dp_exposed, memory_per_gpu, params_per_gpu, step_time
from course_lib.memory.estimate import GB, model_state_bytes, param_count


@dataclass(frozen=True)
class Experts:
    n_experts: int = 8  # E per layer
    top_k: int = 2  # k experts per token


def expert_params(shape):
    """One expert of one layer: a 4h-wide MLP, 8 h^2 + 5 h."""
    return 8 * shape.dim * shape.dim + 5 * shape.dim


def ep_groups(mesh, ep):
    """The global ranks of every ep group: ep consecutive dp coordinates, the other
    coordinates shared, ranks placed as :class:`~course_lib.hybrid.four_d.FourDims` lays
    them out (tp fastest, then cp, dp, pp)."""
    stride = mesh.cp * mesh.tp
    return [[(s * mesh.dp + d) * stride + c * mesh.tp + t for d in range(first, first + ep)]
            for s in range(mesh.pp) for first in range(0, mesh.dp, ep)
            for c in range(mesh.cp) for t in range(mesh.tp)]


def a2a_seconds(gpu, mesh, ep, per_peer):
    """One all-to-all sending ``per_peer`` bytes to each other rank of its ep group, on
    the GPU whose group is placed worst: its NVLink and InfiniBand shares at once, one
    latency (every message is posted together)."""
    if ep == 1:
        return 0.0
    worst = 0.0
    for group in ep_groups(mesh, ep):
        for rank in group:
            near = sum(r // gpu.gpus_per_node == rank // gpu.gpus_per_node for r in group) - 1
            far = ep - 1 - near
            nvlink = (near * per_peer / (gpu.nvlink_pair_gbps * 1e9) if gpu.nvswitch
                      else per_peer / (gpu.nvlink_pair_gbps * 1e9) if near else 0.0)
            infiniband = far * per_peer / (gpu.ib_gbps * 1e9)
            alpha = gpu.ib_alpha_s if far else gpu.nvlink_alpha_s
            worst = max(worst, alpha + max(nvlink, infiniband))
    return worst


def moe_costs(shape, mesh, work, gpu, experts=Experts(), ep=1, efficiency=1.0):
    """{"memory": bytes per GPU, "fits" (as :func:`costs.fits`, 10% kept), "compute",
    "a2a", "expert_sync", "total" (seconds per step: the dense step's total with these
    three parts added or replaced), "tokens_per_s"} for the MoE on ``mesh`` at ``ep``."""
    n_experts, k = experts.n_experts, experts.top_k
    if ep < 1 or mesh.dp % ep or n_experts % ep:
        raise ValueError(f"ep={ep} must divide dp={mesh.dp} and the {n_experts} experts")
    if not 1 <= k <= n_experts:
        raise ValueError(f"top_k must be in [1, {n_experts}], got {k}")
    dense, t = memory_per_gpu(shape, mesh, work), step_time(shape, mesh, work, gpu, efficiency)
    layers = math.ceil(shape.layers / mesh.pp)  # the fullest stage's
    one_mlp = layers * expert_params(shape) / mesh.tp  # per layer, this GPU's share
    same = mesh.dp * mesh.cp  # ranks holding the same dense weights
    held = one_mlp * n_experts / ep
    memory = (dense["total"] - model_state_bytes(one_mlp, same, work.zero)["total"]
              + model_state_bytes(held, same // ep, work.zero)["total"])
    compute = t["compute"] * (1 + (k - 1) * shape.layers * expert_params(shape)
                              / param_count(shape))
    m = work.microbatches(mesh)
    copies = work.micro_batch * shape.seq_len / mesh.cp * k  # a GPU's token copies
    per_peer = 2 * copies * shape.dim / mesh.tp / ep  # bf16, even routing
    a2a = (6 if work.checkpointing else 4) * layers * m * a2a_seconds(gpu, mesh, ep, per_peer)
    backward = compute / m * (6 / 8 if work.checkpointing else 4 / 6)
    link = _link(gpu, mesh, "dp")
    shared = params_per_gpu(shape, mesh) - one_mlp
    dense_sync = dp_exposed(2 * shared, same, m, work.zero, compute, backward, link)
    if ep == 1:  # the experts travel with the shared weights, in the same collectives
        sync = dp_exposed(2 * (shared + held), same, m, work.zero, compute, backward,
                          link) - dense_sync
    else:
        sync = dp_exposed(2 * held, same // ep, m, work.zero, compute, backward, link)
    bubble = compute * (mesh.pp - 1) / m
    total = (t["total"] - t["compute"] - t["bubble"] - t["dp_comm"] + compute + bubble
             + dense_sync + a2a + sync)
    return {"memory": memory, "fits": memory <= 0.9 * gpu.memory_gb * GB, "compute": compute,
            "a2a": a2a, "expert_sync": sync, "total": total,
            "tokens_per_s": work.global_batch * shape.seq_len / total}


def ep_table(shape, mesh, work, gpu, experts=Experts(), efficiency=1.0, echo=True):
    """Rows (ep, GB per GPU, fits, a2a s, expert_sync s, step s, tokens/s) for every ep
    that divides dp and E; ``echo`` prints them."""
    rows = []
    for ep in range(1, mesh.dp + 1):
        if mesh.dp % ep or experts.n_experts % ep:
            continue
        c = moe_costs(shape, mesh, work, gpu, experts, ep, efficiency)
        rows.append((ep, c["memory"] / GB, c["fits"], c["a2a"], c["expert_sync"], c["total"],
                     c["tokens_per_s"]))
    if echo:
        print(f"{'ep':>4} {'GB/GPU':>8} {'fits':>5} {'a2a s':>7} {'sync s':>7} {'step s':>7} "
              f"{'tokens/s':>10}")
        for ep, gb, fit, a2a, sync, total, tps in rows:
            print(f"{ep:>4} {gb:>8.1f} {'yes' if fit else 'no':>5} {a2a:>7.2f} {sync:>7.2f} "
                  f"{total:>7.2f} {tps:>10,.0f}")
    return rows


__all__ = ["Experts", "expert_params", "ep_groups", "a2a_seconds", "moe_costs", "ep_table"]
