import matplotlib
import pytest

matplotlib.use("Agg")

from course_lib.collectives.ring_viz import draw_ring_step, ring_all_reduce_plan, simulate  # noqa: E402


@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_plan_reduces_then_gathers_every_chunk(world):
    everyone = frozenset(range(world))
    plan = ring_all_reduce_plan(world)
    assert len(plan) == 2 * (world - 1)
    for entry in plan:  # one chunk per rank per step, always to the right neighbour
        assert sorted(src for src, _, _ in entry["transfers"]) == list(range(world))
        assert all(dst == (src + 1) % world for src, dst, _ in entry["transfers"])
    after_rs = simulate(world, world - 1)
    for r in range(world):  # reduce-scatter: rank r owns the full sum of chunk r
        assert after_rs[r][r] == everyone
        assert sum(h == everyone for h in after_rs[r]) == 1
    assert simulate(world, 2 * (world - 1)) == [[everyone] * world] * world


def test_drawing_marks_the_chunks_being_sent():
    ax = draw_ring_step(3, 0)
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("0") == 3 and "Σ all" not in texts
    outlined = [p for p in ax.patches if not p.get_fill()]
    assert len(outlined) == 3
    final = draw_ring_step(3, 4)
    assert [t.get_text() for t in final.texts] == ["Σ all"] * 9
    assert "done" in final.get_title()
    with pytest.raises(ValueError):
        draw_ring_step(3, 5)
