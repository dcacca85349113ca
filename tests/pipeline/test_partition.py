"""The partitioner against brute force, and its bad inputs."""
import random

import pytest

from course_lib.pipeline import bottleneck, even_split, partition, partition_brute_force
from course_lib.pipeline.partition import check_ranges


def test_matches_brute_force_on_random_costs():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 11)
        p = rng.randint(1, n)
        costs = [rng.choice([rng.randint(0, 9), round(rng.uniform(0, 5), 3)]) for _ in range(n)]
        got = partition(costs, p)
        check_ranges(got, n, p)
        assert bottleneck(costs, got) == pytest.approx(
            bottleneck(costs, partition_brute_force(costs, p))), (costs, p, got)


def test_small_cases_by_hand():
    assert partition([4, 1, 1, 1, 1, 4], 3) == [range(0, 1), range(1, 5), range(5, 6)]
    assert partition([1, 1, 1, 1], 4) == [range(i, i + 1) for i in range(4)]
    assert partition([5, 3, 2], 1) == [range(0, 3)]
    assert bottleneck([9, 1, 1, 1], partition([9, 1, 1, 1], 2)) == 9  # one layer bounds it


def test_even_split_and_range_checks():
    assert even_split(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    check_ranges(even_split(5, 5), 5, 5)
    with pytest.raises(ValueError, match="stage 1 starts at layer 3, expected 2"):
        check_ranges([range(0, 2), range(3, 5)], 5, 2)
    with pytest.raises(ValueError, match="stage 0 is empty"):
        check_ranges([range(0, 0), range(0, 5)], 5, 2)
    with pytest.raises(ValueError, match="end at layer 4, but there are 5"):
        check_ranges([range(0, 2), range(2, 4)], 5, 2)


@pytest.mark.parametrize("costs,p,message", [
    ([1, 2], 3, "cannot cut 2 layers into 3"),
    ([1, -2, 3], 2, "layer 1's cost must be a number >= 0"),
    ([1, float("nan")], 1, "layer 1's cost"),
    ([1, 2], 0, "positive number of stages"),
])
def test_bad_inputs_are_refused(costs, p, message):
    for fn in (partition, partition_brute_force):
        with pytest.raises(ValueError, match=message):
            fn(costs, p)
