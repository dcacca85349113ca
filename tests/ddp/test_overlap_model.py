"""The projected bucket sweep (pure arithmetic): one bucket overlaps nothing, tiny ones
drown in latency, a middling cap hides all but about one bucket's all-reduce."""
import pytest

from course_lib.collectives.cost_model import ring_all_reduce_time
from course_lib.ddp.overlap_model import MB, exposed_communication, projected_bucket_sweep

P, FWD, BWD, K, ALPHA, B = 4 * 124e6, 4e-3, 8e-3, 8, 3e-6, 450e9


def test_one_bucket_of_everything_is_all_exposed():
    assert exposed_communication(P, BWD, P, K, ALPHA, B) == pytest.approx(
        ring_all_reduce_time(P, K, ALPHA, B))


def test_a_middling_cap_hides_all_but_the_last_bucket_and_tiny_ones_pay_latency():
    sweep = projected_bucket_sweep(P, FWD, BWD, [0.01, 25, 1000], K, ALPHA, B)
    last_bucket = ring_all_reduce_time(P - 25 * MB * (P // (25 * MB)), K, ALPHA, B)
    assert sweep[25] - FWD - BWD == pytest.approx(last_bucket, rel=1e-6)
    assert sweep[0.01] > sweep["after backward"] > sweep[25]
    assert sweep[1000] == pytest.approx(sweep["after backward"])  # one bucket: no overlap


def test_when_communication_outlasts_backward_the_excess_is_exposed():
    slow = exposed_communication(P, 1e-6, 25 * MB, K, ALPHA, 1e9)  # a slow link
    assert slow == pytest.approx(
        sum(ring_all_reduce_time(min(25 * MB, P - i * 25 * MB), K, ALPHA, 1e9)
            for i in range(-(-int(P) // (25 * MB)))) - 1e-6, rel=1e-3)
