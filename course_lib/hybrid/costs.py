"""What one mesh (dp, tp, pp, and cp) costs on paper: memory per GPU, step time, MFU (Lab 06).

Pure arithmetic on the lecture's formulas, for OLMo-sized models on real nodes.
Notation: s = T tokens per sequence, b the microbatch (sequences per model
replica), h = D, N layers, V vocabulary, P parameters (:func:`param_count`);
n = dp * cp * tp * pp GPUs, m = global_batch / (dp b) microbatches per step; c = cp
cuts every sequence into c chunks of s/c tokens (context parallelism, Lab 07: the ring
of K, V blocks), laid out between tp and dp as :mod:`~course_lib.hybrid.four_d` lays it.

    memory_per_gpu(OLMO["OLMo 7B"], Mesh(dp=16, pp=2), Workload())["total"] / GB
    step_time(OLMO["OLMo 7B"], Mesh(dp=16, pp=2), Workload(), H100_80GB)["mfu"]

:mod:`course_lib.hybrid.plan` searches the meshes with them.

**Memory**, on the pipeline stage that needs the most:

- model state: 16 bytes per parameter the GPU holds (bf16 weights and gradients,
  fp32 master copy, Adam's m and v), sharded over the dp c ranks that hold the same
  weights by the ZeRO stage (torchtitan shards over dp x cp too); with ZeRO-3 the unit
  in use and the one prefetched are whole as well;
- activations (Korthikanti et al., FlashAttention, sequence parallelism):
  34 s b h / tp bytes per layer per microbatch in flight, and 1F1B keeps
  min(pp - stage, m) in flight; with checkpointing a layer keeps only its input,
  2 s b h / tp, and one layer is whole while it is recomputed. The last stage
  adds one microbatch's fp32 logits, 4 s b V / tp. Every activation term is divided by
  c: a GPU holds its chunk of each sequence;
- left out: the CUDA context and NCCL's buffers (a few GB), the allocator's
  fragmentation, transient buffers (gradient buckets, the loss's softmax), the
  embedding's output. :func:`fits` keeps a reserve for them.

**Step time**, at the GPU's peak times ``efficiency`` (real kernels: 0.5-0.7),
every communication on the critical path unless said otherwise:

- compute: 6 FLOPs per parameter per token (8 with recompute: one more forward),
  on the GPU that holds the most parameters, its tokens a 1/(dp c) share; attention's
  s^2 term is left out, as in the notes' 6P (and with it CP's share of it, which at long
  sequences is most of the work and what hides the ring);
- bubble: compute (pp-1)/m, so the pipeline idles (p-1)/(m+p-1) of the time;
- tp_comm: per layer per microbatch 4 all-reduces of b s h bf16 (6 with
  recompute; sequence parallelism's all-gather + reduce-scatter costs the same);
- pp_comm: :func:`pp_messages` messages of b s h / tp bf16 (sequence parallelism
  leaves each tp rank a 1/tp slice of the activation to send);
- cp_comm: the ring, per layer per microbatch c - 1 steps forward, each passing a K, V
  chunk of 2 b (s/c) h / tp bf16 behind 1/c of the layer's forward; backward about twice
  that behind twice the compute (K, V again and their gradients: c - 1 and c messages,
  counted as 2(c - 1)); with checkpointing the recompute runs the forward ring again.
  What a step's compute cannot hide is charged;
- dp_comm: what of the gradient and parameter traffic compute cannot hide
  (:func:`dp_exposed`), over the dp c ranks that hold the same weights;
- MFU = 6 P tokens / (total n peak): recompute, bubble and waiting all lower it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from course_lib.collectives.cost_model import p2p_time, reduce_scatter_time, ring_all_reduce_time
from course_lib.memory.estimate import (GB, activation_bytes_megatron, fsdp_peak_param_bytes,
                                        model_state_bytes, param_count, piece_params)
from course_lib.hybrid.four_d import FourDims
from course_lib.pipeline.partition import even_split
from course_lib.tp.volume import (GPUS_PER_NODE, H100_BF16_DENSE_TFLOPS, INFINIBAND_GBPS,
                                  NVLINK_GPU_GBPS, NVLINK_PAIR_GBPS)

# Latency per message (per ring step): assumed orders of magnitude of NCCL's
# small-message times, not measured here (Lab 01 fits alpha on its own machine).
# They only matter for small messages: OLMo's b s h are megabytes.
NVLINK_ALPHA_S = 3e-6
IB_ALPHA_S = 10e-6


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    tflops: float  # dense bf16 peak
    nvlink_pair_gbps: float  # GB/s, one direction, between two GPUs of a node
    ib_gbps: float  # GB/s, one direction, per GPU, between nodes
    gpus_per_node: int = GPUS_PER_NODE
    nvlink_alpha_s: float = NVLINK_ALPHA_S
    ib_alpha_s: float = IB_ALPHA_S
    nvswitch: bool = False  # links through switches: a GPU reaches any one peer at full speed


# The lecture's nodes (constants and their derivation in course_lib.tp.volume).
H100_80GB = GPU("H100 80GB", 80, H100_BF16_DENSE_TFLOPS, NVLINK_PAIR_GBPS, INFINIBAND_GBPS)
# A100 SXM: 312 TFLOPS dense bf16 (the spec sheet's 624 assumes 2:4 sparsity).
# NVLink 3 gives each GPU 12 links of 25 GB/s each way (300 GB/s); on a 4-GPU
# board 4 of them go to each peer: 100 GB/s each way per pair. The notes give
# InfiniBand only for the H100 nodes (NDR); HDR, 200 Gb/s = 25 GB/s per GPU, is
# an assumption.
A100_40GB = GPU("A100 40GB", 40, 312.0, 4 * 25.0, 200 / 8)
GPUS = {"A100 40GB": A100_40GB, "H100 80GB": H100_80GB}
# An 8-GPU H100 node (DGX/HGX): every GPU's 18 NVLink 4 links go to NVSwitches, 450 GB/s
# each way to any mix of peers, so one pair talks at the whole 450, and a ring rank,
# which sends to one peer, sends at 450 (as in Lab 01 and cp.projection), whatever the
# ring's size. (The lecture's 4-GPU boards wire links to each peer: 150 GB/s a pair.)
H100_NVSWITCH_NODE = GPU("H100 80GB, 8-GPU NVSwitch node", 80, H100_BF16_DENSE_TFLOPS,
                         NVLINK_GPU_GBPS, INFINIBAND_GBPS, gpus_per_node=8, nvswitch=True)


@dataclass(frozen=True)
class Mesh:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # last: Mesh(dp, tp, pp) reads as it always did

    @property
    def n_gpus(self):
        return self.dp * self.cp * self.tp * self.pp

    def __str__(self):
        return f"dp={self.dp} tp={self.tp} pp={self.pp}" + (f" cp={self.cp}" if self.cp > 1 else "")


@dataclass(frozen=True)
class Workload:
    """One optimizer step. The default global batch is OLMo 1B's and 7B's: about
    4M tokens, 2048 sequences of 2048. A microbatch of one sequence keeps the
    bubble (p-1)/(m+p-1) small; at peak rates a larger one gains only fewer
    messages, and costs activation memory."""
    global_batch: int = 2048  # sequences per step, over all replicas (70B too: an assumption)
    micro_batch: int = 1  # sequences per microbatch per model replica
    checkpointing: bool = False  # keep only each layer's input, recompute in backward
    zero: int = 1  # ZeRO stage over dp: 0 DDP, 1 optimizer, 2 + grads, 3 + params (FSDP)

    def __post_init__(self):
        if self.global_batch < 1 or self.micro_batch < 1:
            raise ValueError(f"batch sizes must be positive, got {self}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0-3, got {self.zero}")

    def microbatches(self, mesh):
        """m = global_batch / (dp b): each replica's share, in microbatches."""
        m, rest = divmod(self.global_batch, mesh.dp * self.micro_batch)
        if rest or not m:
            raise ValueError(f"global batch {self.global_batch} does not split into "
                             f"dp={mesh.dp} replicas of microbatches of {self.micro_batch}")
        return m


def _stages(shape, mesh):
    """Per pipeline stage (its blocks, its units' parameters on one tp rank). Units
    are the blocks, the first stage's embeddings D(V+T) and the last's final norm
    and head 2D + V(D+1). All are split over tp: the blocks' matrices as Megatron
    does, the vocabulary as its vocab-parallel embedding and head do; the norms'
    and biases' replication (under 0.1% of a block) is ignored."""
    embed, block, head = piece_params(shape)
    out = []
    for s, layers in enumerate(even_split(shape.layers, mesh.pp)):
        units = [block] * len(layers) + [embed] * (s == 0) + [head] * (s == mesh.pp - 1)
        out.append((len(layers), [u / mesh.tp for u in units]))
    return out


def params_per_gpu(shape, mesh):
    """Parameters on the GPU that holds the most: its stage's share on one tp rank.
    With dp = tp = pp = 1, P."""
    return max(sum(units) for _, units in _stages(shape, mesh))


def _stage_memory(shape, mesh, work, stage, layers, units):
    replicas = mesh.dp * mesh.cp  # the ranks holding the same weights
    state = model_state_bytes(sum(units), n=replicas, stage=work.zero)
    if work.zero == 3 and replicas > 1:
        # the unit computing and the one prefetched (FSDP2's default) are gathered whole
        state["params"] = fsdp_peak_param_bytes([2 * u for u in units], replicas, prefetch=1)
    s, b, h = shape.seq_len / mesh.cp, work.micro_batch, shape.dim  # this GPU's chunk
    layer = activation_bytes_megatron(shape, b, flash=True) / shape.layers / mesh.tp / mesh.cp
    in_flight = min(mesh.pp - stage, work.microbatches(mesh))
    if work.checkpointing:
        acts = layers * in_flight * 2 * s * b * h / mesh.tp + layer
    else:
        acts = layers * in_flight * layer
    if stage == mesh.pp - 1:
        # 1F1B's last stage runs each backward right after its forward: one microbatch's logits
        acts += 4 * s * b * shape.vocab / mesh.tp
    out = {"params": state["params"], "grads": state["grads"],
           "optimizer": state["optimizer"], "activations": acts}
    out["total"] = sum(out.values())
    return out


def memory_per_gpu(shape, mesh, work):
    """Bytes {"params", "grads", "optimizer", "activations", "total"} on the stage
    whose total is largest (stage 0 keeps the most microbatches in flight, the
    last one holds the head and the logits)."""
    return max((_stage_memory(shape, mesh, work, i, layers, units)
                for i, (layers, units) in enumerate(_stages(shape, mesh))),
               key=lambda mem: mem["total"])


def fits(shape, mesh, work, gpu, reserve=0.1):
    """Whether the model's total leaves ``reserve`` of the card for what it leaves out."""
    return memory_per_gpu(shape, mesh, work)["total"] <= (1 - reserve) * gpu.memory_gb * GB


# the groups a dim's traffic runs in: gradients go over every rank holding the same weights
_GROUP_DIMS = {"tp": ("tp",), "pp": ("pp",), "cp": ("cp",), "dp": ("dp", "cp")}


@lru_cache(maxsize=None)
def _spans_nodes(mesh, dim, gpus_per_node):
    dims = FourDims(dp=mesh.dp, cp=mesh.cp, tp=mesh.tp, pp=mesh.pp)
    for ranks in {tuple(dims.group_ranks(_GROUP_DIMS[dim], r)) for r in range(mesh.n_gpus)}:
        if len({r // gpus_per_node for r in ranks}) > 1:
            return True
    return False


def _link(gpu, mesh, dim):
    """(alpha in s, bytes/s) of the groups along ``dim``, ranks placed as torchrun
    numbers them and laid out as FourDims (tp fastest, then cp, dp, pp). While every group
    sits in a node,
    NVLink: on a board wired GPU to GPU a collective over g ranks runs several rings in
    different orders and so uses the links to all g-1 peers (tp.volume's
    ``link_bandwidth(all_links=True)``), a pipeline message goes over the one pair's
    links, and so does a step of the cp ring; through NVSwitches each ring rank already
    sends at the GPU's whole bandwidth.
    Once a group spans nodes, InfiniBand, since a ring or a chain runs at its slowest hop."""
    if _spans_nodes(mesh, dim, gpu.gpus_per_node):
        return gpu.ib_alpha_s, gpu.ib_gbps * 1e9
    size = math.prod(getattr(mesh, d) for d in _GROUP_DIMS[dim])
    peers = 1 if dim in ("pp", "cp") or gpu.nvswitch else max(1, min(size - 1, gpu.gpus_per_node - 1))
    return gpu.nvlink_alpha_s, gpu.nvlink_pair_gbps * peers * 1e9


def pp_messages(p, m):
    """Message times 1F1B's p2p adds to a step: 2(p-1) + 2 floor((m-1)(p-1)/p).

    The first microbatch pays every boundary down and back; of the rest, each
    adds two unless it lands while its stage is busy, one in p. This is what
    :func:`~course_lib.pipeline.simulate.simulate` gives for ``one_f_one_b(p, m)``
    exactly, while a message is shorter than a forward."""
    return 2 * (p - 1) + 2 * ((m - 1) * (p - 1) // p)


def dp_exposed(grad_bytes, dp, m, zero, compute, backward, link):
    """Seconds of dp traffic that compute cannot hide. ``grad_bytes`` is a rank's
    bf16 gradient (the same size as its bf16 parameters), ``compute`` the step's,
    ``backward`` one microbatch's backward; RS and AG are ring reduce-scatter and
    all-gather (an all-reduce is both):

    - ZeRO-0: gradients accumulate locally; one all-reduce behind the last backward;
    - ZeRO-1: the reduce-scatter overlaps only the last microbatch's backward too;
      the all-gather of the updated parameters comes after the optimizer, with
      nothing to hide behind;
    - ZeRO-2: sharded gradients cannot accumulate unreduced: an RS behind every
      microbatch's backward, and the AG after the step;
    - ZeRO-3: every microbatch gathers the parameters in forward and again in
      backward, and reduce-scatters (1.5 all-reduces), behind its whole compute."""
    alpha, bandwidth = link
    rs = reduce_scatter_time(grad_bytes, dp, alpha, bandwidth)  # == an all-gather's
    if zero == 0:
        return max(0.0, ring_all_reduce_time(grad_bytes, dp, alpha, bandwidth) - backward)
    if zero == 1:
        return max(0.0, rs - backward) + rs
    if zero == 2:
        return m * max(0.0, rs - backward) + rs
    return m * max(0.0, 3 * rs - compute / m)


def step_time(shape, mesh, work, gpu, efficiency=1.0):
    """Seconds per step {"compute", "bubble", "tp_comm", "pp_comm", "cp_comm", "dp_comm",
    "total"} and "mfu", as the module's docstring lays out."""
    m = work.microbatches(mesh)
    tokens = work.global_batch * shape.seq_len
    stages = _stages(shape, mesh)
    # 6 FLOPs per parameter per token, the embeddings counted as the 6P convention
    # counts them (they are lookups): MFU stays <= 1, and stage 0 looks a little heavier
    p_gpu = max(sum(units) for _, units in stages)
    layers = max(n for n, _ in stages)  # the slowest stage sets the pace
    flops = (8 if work.checkpointing else 6) * p_gpu * tokens / (mesh.dp * mesh.cp)
    compute = flops / (gpu.tflops * 1e12 * efficiency)
    backward = compute / m * (6 / 8 if work.checkpointing else 4 / 6)
    act = 2 * work.micro_batch * shape.seq_len * shape.dim / mesh.cp  # b (s/c) h in bf16
    ring_step = float(p2p_time(2 * act / mesh.tp, *_link(gpu, mesh, "cp"))) if mesh.cp > 1 else 0
    forward = compute / m * (2 / 8 if work.checkpointing else 2 / 6)  # one microbatch's
    hidden = forward / (layers * mesh.cp)  # the forward compute behind one ring step
    ring_steps = (4 if work.checkpointing else 3) * (mesh.cp - 1)  # forward, backward ~2x
    tp_ops = 6 if work.checkpointing else 4
    out = {
        "compute": compute,
        "bubble": compute * (mesh.pp - 1) / m,
        "tp_comm": tp_ops * layers * m * ring_all_reduce_time(act, mesh.tp,
                                                              *_link(gpu, mesh, "tp")),
        "pp_comm": pp_messages(mesh.pp, m) * float(p2p_time(act / mesh.tp,
                                                            *_link(gpu, mesh, "pp"))),
        "cp_comm": ring_steps * layers * m * max(0.0, ring_step - hidden),
        "dp_comm": dp_exposed(2 * p_gpu, mesh.dp * mesh.cp, m, work.zero, compute, backward,
                              _link(gpu, mesh, "dp")),
    }
    out["total"] = sum(out.values())
    out["mfu"] = 6 * param_count(shape) * tokens / (out["total"] * mesh.n_gpus * gpu.tflops * 1e12)
    return out


__all__ = ["GPU", "H100_80GB", "A100_40GB", "GPUS", "H100_NVSWITCH_NODE", "Mesh", "Workload", "params_per_gpu",
           "memory_per_gpu", "fits", "pp_messages", "dp_exposed", "step_time", "NVLINK_ALPHA_S",
           "IB_ALPHA_S"]
