"""Tensor parallelism on paper: bytes per layer, 1D against 2D/3D grids, and the links they cross.

**Megatron (1D).** Per transformer layer, 2 all-reduces forward and 2 backward,
each of the activation, b*s*h elements. A ring all-reduce over t ranks sends
2(t-1)/t of the array from every rank, so each rank sends per layer

    4 * 2(t-1)/t * b*s*h * bytes_per_element        (forward + backward)

which does not shrink as t grows: the activation is replicated, and every rank
must see all of it.

**Grids (in the spirit of AxoNN).** Arrange G = gx * gy * gz GPUs in a grid and
take one layer Y = X A, X of (m, k) (m = b*s tokens), A of (k, n). GPU (i, j, l)
holds A's block (i, j) of (k/gx, n/gy), sharded further over gz (as FSDP
would), and X's block of rows l (m/gz) and columns i (k/gx). Per GPU:

- forward: all-gather its A block over gz, multiply, all-reduce the partial
  output (m/gz, n/gy) over gx;
- backward: all-reduce dX (m/gz, k/gx) over gy, reduce-scatter dA over gz.

With ring collectives (an all-reduce of S sends 2(p-1)/p S per rank, an
all-gather or reduce-scatter whose whole array is S sends (p-1)/p S) that is
:func:`grid_volume`. Megatron's column-parallel layer is the grid (1, t, 1),
its row-parallel layer (t, 1, 1): together, one all-reduce of (m, n) forward
and one of (m, k) backward, the 1D numbers above. Consecutive layers swap the
roles of gx and gy (a layer's output is split the way the next one's input must
be), as Megatron alternates column and row. What the model leaves out: the
LayerNorm statistics a 2D split of h needs (2 numbers per token), and keeping
gathered weights from forward to backward (3D gathers once per step here).
"""
from __future__ import annotations

import math

# The lecture's cluster (Kempner, H100 nodes): 4 GPUs per node, each pair joined
# by NVLink at 75 GB/s per direction (75 * 6 pairs * 2 directions = 900 GB/s
# for the node); between nodes InfiniBand NDR, 400 Gbit/s = 50 GB/s per GPU.
GPUS_PER_NODE = 4
NVLINK_LINK_GBPS = 75.0  # GB/s, one direction, one GPU pair
NVLINK_PEERS = GPUS_PER_NODE - 1  # links out of each GPU
NVLINK_NODE_TOTAL_GBPS = NVLINK_LINK_GBPS * math.comb(GPUS_PER_NODE, 2) * 2  # 900
INFINIBAND_GBPS = 400 / 8  # 50 GB/s per GPU, each direction
H100_BF16_DENSE_TFLOPS = 989.0  # the spec sheet's 1,979 assumes 2:4 sparsity


def all_reduce_sent(size, p):
    """Elements (or bytes) a rank sends in a ring all-reduce of ``size`` over p ranks."""
    return 2 * (p - 1) / p * size


def gather_sent(size, p):
    """Sent per rank by a ring all-gather or reduce-scatter whose whole array is ``size``."""
    return (p - 1) / p * size


def tp_layer_bytes(b, s, h, t, bytes_per_element=2):
    """Bytes each rank sends per transformer layer, forward and backward, under
    Megatron's 1D tensor parallelism over t ranks: 4 all-reduces of b*s*h."""
    return 4 * all_reduce_sent(b * s * h, t) * bytes_per_element


def grid_volume(m, k, n, gx=1, gy=1, gz=1):
    """Elements each GPU sends for one layer Y = X A (X: (m, k), A: (k, n)) on a
    gx x gy x gz grid: ``{"forward": ..., "backward": ..., "total": ...}``."""
    for name, size in (("gx", gx), ("gy", gy), ("gz", gz)):
        if int(size) != size or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    weight_block = k * n / (gx * gy)
    forward = gather_sent(weight_block, gz) + all_reduce_sent(m / gz * n / gy, gx)
    backward = all_reduce_sent(m / gz * k / gx, gy) + gather_sent(weight_block, gz)
    return {"forward": forward, "backward": backward, "total": forward + backward}


def block_layers(h):
    """The course block's four matmuls as (name, k, n): q/k/v, output projection, MLP up, down."""
    return [("qkv", h, 3 * h), ("proj", h, h), ("mlp up", h, 4 * h), ("mlp down", 4 * h, h)]


def _grid_total(m, k, n, gx, gy, gz):
    return grid_volume(m, k, n, gx, gy, gz)["total"]


def block_volume(m, h, grid, layer_volume=None):
    """Elements each GPU sends per transformer block (forward + backward) on
    ``grid`` = (gx, gy, gz); consecutive matmuls swap gx and gy. ``layer_volume(m,
    k, n, gx, gy, gz)`` gives one layer's total (default: :func:`grid_volume`'s)."""
    layer_volume = layer_volume or _grid_total
    gx, gy, gz = (tuple(grid) + (1, 1, 1))[:3]
    total = 0.0
    for i, (_, k, n) in enumerate(block_layers(h)):
        a, b = (gx, gy) if i % 2 == 0 else (gy, gx)
        total += layer_volume(m, k, n, a, b, gz)
    return total


def factorizations(g, dims):
    """Every way to write g as an ordered product of ``dims`` positive integers."""
    if dims == 1:
        return [(g,)]
    return [(d, *rest) for d in range(1, g + 1) if g % d == 0
            for rest in factorizations(g // d, dims - 1)]


def best_grid(m, h, g, dims, layer_volume=None):
    """(volume, grid) of the cheapest ``dims``-dimensional grid of g GPUs for one
    block: dims=1 is Megatron's line (g, 1, 1) with columns and rows alternating."""
    if dims == 1:
        return block_volume(m, h, (1, g, 1), layer_volume), (1, g, 1)
    grids = [f + (1,) * (3 - dims) for f in factorizations(g, dims)]
    return min((block_volume(m, h, grid, layer_volume), grid) for grid in grids)


def link_bandwidth(t, gpus_per_node=GPUS_PER_NODE, all_links=False):
    """GB/s a rank of a t-way tensor-parallel ring can send at, one direction: an
    NVLink (or, ``all_links``, all of a GPU's NVLinks, as NCCL's several rings
    use them) while the group fits in a node, InfiniBand once it spans nodes: a
    ring runs at the speed of its slowest hop."""
    if t <= gpus_per_node:
        return NVLINK_LINK_GBPS * (min(t - 1, NVLINK_PEERS) if all_links else 1)
    return INFINIBAND_GBPS


def layer_times(b, s, h, t, bytes_per_element=2, tflops=H100_BF16_DENSE_TFLOPS,
                gpus_per_node=GPUS_PER_NODE, all_links=False):
    """Seconds per transformer layer on each GPU, forward + backward, at peak
    rates: ``{"compute": ..., "comm": ..., "bytes": ...}``. Compute is
    3 x (24 b s h^2 + 4 b s^2 h) FLOPs split over t; comm is
    :func:`tp_layer_bytes` at :func:`link_bandwidth`."""
    flops = 3 * (24 * b * s * h * h + 4 * b * s * s * h) / t
    sent = tp_layer_bytes(b, s, h, t, bytes_per_element)
    comm = 0.0 if t == 1 else sent / (link_bandwidth(t, gpus_per_node, all_links) * 1e9)
    return {"compute": flops / (tflops * 1e12), "comm": comm, "bytes": sent}


def best_grids_table(m, h, gpu_counts, layer_volume=None):
    """Rows (G, 1D, best 2D, best 3D), each (elements per GPU, grid), for the plot."""
    return [(g, *(best_grid(m, h, g, d, layer_volume) for d in (1, 2, 3))) for g in gpu_counts]


__all__ = ["GPUS_PER_NODE", "NVLINK_LINK_GBPS", "NVLINK_PEERS", "NVLINK_NODE_TOTAL_GBPS",
           "INFINIBAND_GBPS", "H100_BF16_DENSE_TFLOPS", "all_reduce_sent", "gather_sent",
           "tp_layer_bytes", "grid_volume", "block_layers", "block_volume", "factorizations",
           "best_grid", "link_bandwidth", "layer_times", "best_grids_table"]
