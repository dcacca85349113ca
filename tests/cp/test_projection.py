"""The projection of a ring step on H100s: compute grows as s^2, the send as s, and they
cross at the hiding point; under zigzag a step computes half a block, counted from the
pieces the ring itself computes."""
import numpy as np
import pytest

from course_lib.cp.projection import LINKS, block_share, hiding_point, ring_step_times
from course_lib.cp.ring_attention import piece_scores, pieces_seen


@pytest.mark.parametrize("link", list(LINKS))
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_send_hides_beyond_the_hiding_point(link, layout):
    star = hiding_point(link, layout=layout)
    compute, send = ring_step_times([star / 4, star * 4], batch=1, dim=4096, link=link,
                                    layout=layout)
    assert compute[0] < send[0] and compute[1] > send[1]
    # at the point itself only alpha is left between them
    compute, send = ring_step_times([star], batch=1, dim=4096, link=link, layout=layout)
    assert send[0] - compute[0] == pytest.approx(LINKS[link][0], rel=1e-6)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_zigzag_sees_half_of_every_other_block_and_the_contiguous_last_rank_all(n):
    assert block_share("zigzag", n) == 0.5 and block_share("contiguous", n) == 1.0
    # every rank, every off-diagonal step: exactly half under zigzag; over a whole pass a
    # rank computes (2n + 1) / 4 blocks (the diagonal step, two causal squares and a
    # whole one, counted whole as the kernel computes them)
    s = 16
    for r in range(n):
        steps = [piece_scores(pieces_seen(n, r, (r - t) % n, True, "zigzag", s)) / s ** 2
                 for t in range(n)]
        assert steps[1:] == [0.5] * (n - 1)
        assert steps[0] == 0.75 and sum(steps) == pytest.approx((2 * n + 1) / 4)


def test_the_hiding_points_of_the_lecture_s_links():
    """2,200 tokens per rank on NVLink and 20,000 over InfiniBand under zigzag; the
    contiguous layout's slowest rank computes twice as much and hides at half."""
    nvlink, ib = hiding_point("NVLink (in a node)"), hiding_point("InfiniBand (across nodes)")
    assert ib / nvlink == pytest.approx(9.0)
    assert 2_100 < nvlink < 2_300 and 19_000 < ib < 21_000
    assert hiding_point("NVLink (in a node)", layout="contiguous") == pytest.approx(nvlink / 2)
    compute, _ = ring_step_times(np.array([1000, 2000]), 1, 1024, "NVLink (in a node)")
    assert compute[1] == pytest.approx(4 * compute[0])
