"""The projection of a ring step on H100s: compute grows as s^2, the send as s, and they
cross at the hiding point."""
import numpy as np
import pytest

from course_lib.cp.projection import LINKS, hiding_point, ring_step_times


@pytest.mark.parametrize("link", list(LINKS))
def test_the_send_hides_beyond_the_hiding_point(link):
    star = hiding_point(link)
    compute, send = ring_step_times([star / 4, star * 4], batch=1, dim=4096, link=link)
    assert compute[0] < send[0] and compute[1] > send[1]
    # at the point itself only alpha is left between them
    compute, send = ring_step_times([star], batch=1, dim=4096, link=link)
    assert send[0] - compute[0] == pytest.approx(LINKS[link][0], rel=1e-6)


def test_infiniband_needs_nine_times_the_tokens():
    ratio = hiding_point("InfiniBand (across nodes)") / hiding_point("NVLink (in a node)")
    assert ratio == pytest.approx(9.0)
    assert 500 < hiding_point("NVLink (in a node)") < 2000
    compute, _ = ring_step_times(np.array([1000, 2000]), 1, 1024, "NVLink (in a node)")
    assert compute[1] == pytest.approx(4 * compute[0])
