import numpy as np
import pytest

from course_lib.collectives.cost_model import fit_alpha_beta, p2p_time


def test_fit_recovers_alpha_and_bandwidth():
    sizes = np.logspace(2, 8, 13)
    alpha, bw = 50e-6, 2e9
    t = p2p_time(sizes, alpha, bw) * (1 + 0.01 * np.sin(np.arange(13)))  # 1% noise
    fit_alpha, fit_bw = fit_alpha_beta(sizes, t)
    assert fit_alpha == pytest.approx(alpha, rel=0.05)
    assert fit_bw == pytest.approx(bw, rel=0.05)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError):
        fit_alpha_beta([1], [1.0])
    with pytest.raises(ValueError):
        fit_alpha_beta([1, 2, 3], [3.0, 2.0, 1.0])


from course_lib.collectives import cost_model as cm  # noqa: E402


def test_bus_factors_are_nccl_tests():
    assert cm.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert cm.bus_factor("reduce_scatter", 4) == cm.bus_factor("all_gather", 4) == 0.75
    assert cm.bus_factor("broadcast", 8) == 1.0
    assert cm.busbw("all_reduce", 1e9, 1.0, 2) == pytest.approx(1e9)
    with pytest.raises(ValueError):
        cm.bus_factor("gossip", 4)


def test_ring_beats_naive_by_a_factor_k_in_bandwidth_terms():
    n, k = 1e9, 8
    assert cm.naive_all_reduce_time(n, k, 0, 1e9) / cm.ring_all_reduce_time(n, k, 0, 1e9) == pytest.approx(k)
    # allreduce = reduce-scatter + all-gather
    assert cm.ring_all_reduce_time(n, k, 1e-5, 1e9) == pytest.approx(
        cm.reduce_scatter_time(n, k, 1e-5, 1e9) + cm.all_gather_time(n, k, 1e-5, 1e9))
    # latency-bound tiny messages: the naive one has the same 2(K-1) alphas on the root
    assert cm.naive_all_reduce_time(0, k, 1e-5, 1e9) == cm.ring_all_reduce_time(0, k, 1e-5, 1e9)


def test_pipelined_broadcast_and_its_optimum():
    n, k, alpha, bw = 64e6, 8, 50e-6, 1e9
    assert cm.pipelined_broadcast_time(n, k, 1, alpha, bw) == cm.ring_broadcast_time(n, k, alpha, bw)
    best = cm.optimal_segments(n, k, alpha, bw)
    assert abs(best - ((k - 2) * n / (alpha * bw)) ** 0.5) <= 1
    times = {s: cm.pipelined_broadcast_time(n, k, s, alpha, bw) for s in range(1, 400)}
    assert min(times, key=times.get) == best
    # with many segments it approaches N/B, K-1 times better than the ring
    assert times[best] < 1.2 * n / bw < cm.ring_broadcast_time(n, k, alpha, bw) / 5
    assert cm.optimal_segments(n, 2, alpha, bw) == 1


def test_the_projection_tends_to_b_for_the_ring_and_b_over_k_for_the_naive_root():
    from course_lib.collectives.cost_model import H100_NODE, projected_busbw

    k, alpha, b = H100_NODE["ranks"], H100_NODE["alpha"], H100_NODE["bandwidth"]
    naive, ring = projected_busbw([1024, 1 << 40], k, alpha, b).values()
    assert ring[1] == pytest.approx(b, rel=1e-3) and naive[1] == pytest.approx(b / k, rel=1e-3)
    assert ring[0] < 0.01 * b  # 1 KiB: all latency, for both
    assert naive[0] == pytest.approx(ring[0], rel=0.2)


def test_the_node_figures_are_the_ones_the_planner_and_tp_use():
    from course_lib.collectives.cost_model import H100_NODE
    from course_lib.hybrid.costs import NVLINK_ALPHA_S
    from course_lib.tp.volume import NVLINK_GPU_GBPS

    assert H100_NODE["alpha"] == NVLINK_ALPHA_S
    assert H100_NODE["bandwidth"] == NVLINK_GPU_GBPS * 1e9
