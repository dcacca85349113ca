"""The analytic side of tensor parallelism: bytes per layer, grids, links (no processes)."""
import pytest

from course_lib.tp import volume as V


@pytest.mark.parametrize("t", [2, 3, 8])
def test_megatron_column_and_row_layers_are_the_1d_grids(t):
    m, k, n = 10, 6, 12
    column = V.grid_volume(m, k, n, gx=1, gy=t)
    row = V.grid_volume(m, k, n, gx=t, gy=1)
    assert column["forward"] == 0 and column["backward"] == pytest.approx(2 * (t - 1) / t * m * k)
    assert row["backward"] == 0 and row["forward"] == pytest.approx(2 * (t - 1) / t * m * n)


def test_a_3d_grid_by_hand():
    # m=8, k=4, n=6 on (gx, gy, gz) = (2, 3, 2): the weight block is 4*6/6 = 4 elements
    got = V.grid_volume(8, 4, 6, 2, 3, 2)
    assert got["forward"] == pytest.approx(1 / 2 * 4 + 2 * 1 / 2 * (8 / 2) * (6 / 3))  # 2 + 8
    assert got["backward"] == pytest.approx(2 * 2 / 3 * (8 / 2) * (4 / 2) + 1 / 2 * 4)
    assert got["total"] == pytest.approx(got["forward"] + got["backward"])


@pytest.mark.parametrize("b,s,h,t", [(1, 7, 12, 2), (3, 5, 8, 3), (2, 16, 64, 4)])
def test_the_1d_block_sends_four_all_reduces_of_bsh(b, s, h, t):
    expected = 4 * 2 * (t - 1) / t * b * s * h
    assert V.tp_layer_bytes(b, s, h, t, bytes_per_element=1) == pytest.approx(expected)
    assert V.block_volume(b * s, h, (1, t, 1)) == pytest.approx(expected)
    assert V.best_grid(b * s, h, t, 1) == (pytest.approx(expected), (1, t, 1))


def test_more_grid_dimensions_never_cost_more():
    for g in (1, 2, 4, 8, 12, 16, 64):
        one, two, three = (V.best_grid(4096, 1024, g, d)[0] for d in (1, 2, 3))
        assert three <= two <= one
    assert V.best_grid(4096, 1024, 1, 3)[0] == 0
    # past a few GPUs the 1D volume stops shrinking; a 2D grid keeps shrinking
    assert V.best_grid(4096, 1024, 64, 1)[0] > V.best_grid(4096, 1024, 8, 1)[0]
    assert V.best_grid(4096, 1024, 64, 2)[0] < V.best_grid(4096, 1024, 8, 2)[0]


def test_factorizations_are_every_ordered_product():
    assert sorted(V.factorizations(12, 2)) == [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)]
    assert all(a * b * c == 8 for a, b, c in V.factorizations(8, 3))
    assert len(V.factorizations(8, 3)) == 10


def test_links_of_the_lecture_cluster():
    # H100 SXM: 18 NVLink 4 links x 25 GB/s each way = 450 GB/s per GPU each way, and
    # 900 GB/s with both directions added; a 4-GPU board gives each pair 6 links
    assert V.NVLINKS_PER_PAIR == 6 and V.NVLINK_PAIR_GBPS == 150
    assert V.NVLINK_GPU_GBPS == 450 and V.NVLINK_SPEC_SHEET_GBPS == 900
    assert V.NVLINK_PEERS * V.NVLINKS_PER_PAIR == V.NVLINKS_PER_GPU
    assert V.INFINIBAND_GBPS == 50
    assert V.link_bandwidth(2) == V.link_bandwidth(4) == 150
    assert V.link_bandwidth(2, all_links=True) == 150
    assert V.link_bandwidth(3, all_links=True) == 300
    assert V.link_bandwidth(4, all_links=True) == V.NVLINK_GPU_GBPS
    assert V.link_bandwidth(8) == V.link_bandwidth(8, all_links=True) == 50
    inside, across = V.layer_times(1, 4096, 8192, 4), V.layer_times(1, 4096, 8192, 8)
    assert V.layer_times(1, 4096, 8192, 1)["comm"] == 0
    assert inside["comm"] == pytest.approx(inside["bytes"] / 150e9)
    assert across["comm"] == pytest.approx(across["bytes"] / 50e9)
    assert across["comm"] / across["compute"] > inside["comm"] / inside["compute"]


def test_what_the_notebook_says_about_the_links_plot():
    """Section 9's text reads these ratios off the plot (b=1, s=4096, h=8192)."""
    def ratio(t, **kw):
        times = V.layer_times(1, 4096, 8192, t, **kw)
        return times["comm"] / times["compute"]

    assert ratio(2) == pytest.approx(1 / 6, rel=0.03)  # 1.79 ms against 10.8 ms
    assert ratio(4) == pytest.approx(1 / 2, rel=0.03)  # 2.68 ms against 5.42 ms, one peer
    assert ratio(4, all_links=True) == pytest.approx(1 / 6, rel=0.03)
    assert ratio(8) == pytest.approx(3.5, rel=0.03) and ratio(16) == pytest.approx(7.4, rel=0.03)


def test_a_measured_bus_bandwidth_replaces_the_peak():
    measured = V.layer_times(1, 4096, 8192, 4, gbps=120)
    assert measured["comm"] == pytest.approx(measured["bytes"] / 120e9)
    assert measured["compute"] == V.layer_times(1, 4096, 8192, 4)["compute"]
    assert V.layer_times(1, 4096, 8192, 1, gbps=120)["comm"] == 0


def test_grid_sizes_must_be_positive_integers():
    with pytest.raises(ValueError, match="gz must be a positive integer"):
        V.grid_volume(4, 4, 4, 2, 2, 0)
    with pytest.raises(ValueError, match="gx"):
        V.grid_volume(4, 4, 4, 1.5)
