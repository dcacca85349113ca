"""When expert parallelism pays, on paper (Lab 06, with Lab 07's layers).

A mixture-of-experts model here is a dense shape (:mod:`course_lib.hybrid.costs`'s
notation: s, b, h, N layers, P) whose every MLP becomes E experts of the same size,
8 h^2 + 5 h each (a 4h-wide MLP), a token running through k of them. On a mesh
(dp, tp, pp, cp), ep splits the experts over ep of the dp ranks (ep divides dp and E),
as :mod:`course_lib.hybrid.experts` does at ep = dp:

- **memory**: a GPU holds its stage's N/pp layers of E/ep experts, each 1/tp of it
  (Megatron splits an expert as it splits an MLP), their model state sharded by ZeRO
  over the dp c / ep ranks that hold the same experts; the rest as the dense mesh.
  Activations are the dense model's (the k - 1 more expert activations a token leaves
  are left out);
- **compute**: the dense step's, plus (k - 1) more MLPs per token per layer: the active
  parameters grow by (k - 1) N (8 h^2 + 5 h);
- **a2a**: per layer per microbatch, two all-to-alls forward (the tokens out to their
  experts, the results back) and two backward (two more with recompute), each sending
  the (ep - 1)/ep of a GPU's b (s/c) k token copies, h bf16 values each, split over tp,
  that leave for other ranks. On the critical path: the experts wait for their tokens.
  An ep group is ep dp ranks, ep c tp consecutive GPUs: inside a node while that fits
  in one, over NVLink (a board's pair links to the ep - 1 peers at once, a switch's
  whole bandwidth), over InfiniBand once it does not;
- **expert_sync**: the held experts' gradients synchronised over the dp c / ep ranks
  holding them, charged as the dense mesh's dp traffic is (:func:`costs.dp_exposed`),
  less what the dense model's own MLP costs there (already in ``dp_comm``).

At ep = 1 every GPU holds all E experts: the replicated MoE. ::

    moe_costs(OLMO["OLMo 1B"], Mesh(dp=64), Workload(), H100_80GB, Experts(64, 2), ep=8)
    ep_table(OLMO["OLMo 1B"], Mesh(dp=64), Workload(), H100_80GB, Experts(64, 2))
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.collectives.cost_model import p2p_time
from course_lib.hybrid.costs import _link, dp_exposed, memory_per_gpu, step_time
from course_lib.memory.estimate import GB, model_state_bytes, param_count


@dataclass(frozen=True)
class Experts:
    n_experts: int = 8  # E per layer
    top_k: int = 2  # k experts per token


def expert_params(shape):
    """One expert of one layer: a 4h-wide MLP, 8 h^2 + 5 h."""
    return 8 * shape.dim * shape.dim + 5 * shape.dim


def ep_link(gpu, mesh, ep):
    """(alpha in s, bytes/s) of one GPU's all-to-all over an ep group of ``ep``
    consecutive dp ranks, ep c tp consecutive GPUs."""
    if ep * mesh.cp * mesh.tp > gpu.gpus_per_node:
        return gpu.ib_alpha_s, gpu.ib_gbps * 1e9
    peers = 1 if gpu.nvswitch else ep - 1
    return gpu.nvlink_alpha_s, gpu.nvlink_pair_gbps * peers * 1e9


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
    tokens = work.micro_batch * shape.seq_len / mesh.cp * k  # a GPU's token copies
    sent = 2 * tokens * shape.dim / mesh.tp * (ep - 1) / ep  # bf16, to the other ranks
    alpha, bandwidth = ep_link(gpu, mesh, ep)
    per_a2a = (ep - 1) * alpha + sent / bandwidth if ep > 1 else 0.0
    a2a = (6 if work.checkpointing else 4) * layers * m * per_a2a
    backward = compute / m * (6 / 8 if work.checkpointing else 4 / 6)
    link = _link(gpu, mesh, "dp")
    sync = max(0.0, dp_exposed(2 * held, same // ep, m, work.zero, compute, backward, link)
               - dp_exposed(2 * one_mlp, same, m, work.zero, compute, backward, link))
    bubble = compute * (mesh.pp - 1) / m
    total = t["total"] - t["compute"] - t["bubble"] + compute + bubble + a2a + sync
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


__all__ = ["Experts", "expert_params", "ep_link", "moe_costs", "ep_table"]
