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
be), as Megatron alternates column and row. The model assumes the gathered
weight block is kept from forward to backward, so it is all-gathered once per
step and backward only reduce-scatters its gradient (FSDP, as in Lab 03, frees
it after forward and gathers it again in backward: one more (gz-1)/gz of the
block, not counted here). It leaves out the LayerNorm statistics a 2D split of h
needs (2 numbers per token) and the memory the kept blocks take.

**Links.** :func:`link_bandwidth` and :func:`layer_times` use peak rates of the
lecture's nodes (constants below). What a collective really reaches is what
NVIDIA's nccl-tests report as the bus bandwidth, ``busbw``: for an all-reduce,
size / time x 2(t-1)/t, which is what a rank sends in the ring
(:func:`all_reduce_sent`) divided by the time, the same rate these functions
divide bytes by. A measured busbw can replace the peak
(``layer_times(..., gbps=busbw)``).
"""
from __future__ import annotations

# The lecture's cluster (Kempner): nodes of 4 H100 SXM GPUs on an HGX-style board,
# every pair of GPUs joined directly by NVLink; between nodes, InfiniBand NDR.
# An H100 SXM has 18 NVLink 4 links of 25 GB/s per direction: 450 GB/s each way
# per GPU. The spec sheet's 900 GB/s is that per-GPU figure with both directions
# added, not a node's total. On a 4-GPU board each GPU's 18 links go 6 to each of
# its 3 peers: 150 GB/s each way per pair (the node's 6 pairs: 1,800 GB/s, both
# directions added). The lecture notes' "75 GB/s x 6 x 2 = 900 GB/s" for the node
# does not describe this hardware.
GPUS_PER_NODE = 4
NVLINK4_LINK_GBPS = 25.0  # GB/s, one NVLink 4 link, one direction
NVLINKS_PER_GPU = 18
NVLINK_PEERS = GPUS_PER_NODE - 1  # the GPUs each GPU has links to
NVLINKS_PER_PAIR = NVLINKS_PER_GPU // NVLINK_PEERS  # 6
NVLINK_PAIR_GBPS = NVLINK4_LINK_GBPS * NVLINKS_PER_PAIR  # 150: one GPU pair, one direction
NVLINK_GPU_GBPS = NVLINK4_LINK_GBPS * NVLINKS_PER_GPU  # 450: all of one GPU's links, one direction
NVLINK_SPEC_SHEET_GBPS = 2 * NVLINK_GPU_GBPS  # 900: one GPU, both directions added
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
    """Peak GB/s, one direction, at which a rank of a t-way tensor-parallel ring
    sends. While the group fits in a node: the NVLinks to its ring neighbour
    (:data:`NVLINK_PAIR_GBPS`), or with ``all_links`` the links to all of its t-1
    peers in the group (NCCL runs several rings at once, in different orders, to
    use them). Once the group spans nodes: InfiniBand, since a ring runs at the
    speed of its slowest hop."""
    if t <= gpus_per_node:
        return NVLINK_PAIR_GBPS * (max(1, min(t - 1, NVLINK_PEERS)) if all_links else 1)
    return INFINIBAND_GBPS


def layer_times(b, s, h, t, bytes_per_element=2, tflops=H100_BF16_DENSE_TFLOPS,
                gpus_per_node=GPUS_PER_NODE, all_links=False, gbps=None):
    """Seconds per transformer layer on each GPU, forward + backward, at peak
    rates and with no overlap: ``{"compute": ..., "comm": ..., "bytes": ...}``.
    Compute is 3 x (24 b s h^2 + 4 b s^2 h) FLOPs split over t; comm is
    :func:`tp_layer_bytes` at :func:`link_bandwidth`, or at ``gbps`` if given (a
    measured rate: nccl-tests' busbw for an all-reduce of b*s*h elements)."""
    flops = 3 * (24 * b * s * h * h + 4 * b * s * s * h) / t
    sent = tp_layer_bytes(b, s, h, t, bytes_per_element)
    rate = gbps if gbps is not None else link_bandwidth(t, gpus_per_node, all_links)
    comm = 0.0 if t == 1 else sent / (rate * 1e9)
    return {"compute": flops / (tflops * 1e12), "comm": comm, "bytes": sent}


def best_grids_table(m, h, gpu_counts, layer_volume=None):
    """Rows (G, 1D, best 2D, best 3D), each (elements per GPU, grid), for the plot."""
    return [(g, *(best_grid(m, h, g, d, layer_volume) for d in (1, 2, 3))) for g in gpu_counts]


__all__ = ["GPUS_PER_NODE", "NVLINK4_LINK_GBPS", "NVLINKS_PER_GPU", "NVLINK_PEERS",
           "NVLINKS_PER_PAIR", "NVLINK_PAIR_GBPS", "NVLINK_GPU_GBPS", "NVLINK_SPEC_SHEET_GBPS",
           "INFINIBAND_GBPS", "H100_BF16_DENSE_TFLOPS", "all_reduce_sent", "gather_sent",
           "tp_layer_bytes", "grid_volume", "block_layers", "block_volume", "factorizations",
           "best_grid", "link_bandwidth", "layer_times", "best_grids_table"]
