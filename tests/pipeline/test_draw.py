"""Drawing schedules (Agg backend) and the explorer widget."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib.pipeline import gpipe, interleaved_1f1b, one_f_one_b, simulate  # noqa: E402
from course_lib.pipeline.draw import (draw_schedule, draw_simulation, draw_timeline,  # noqa: E402
                                      explore, explorer)


def _boxes(ax):
    return sum(len(c.get_paths()) for c in ax.collections)


def test_one_box_per_action_and_the_bubble_in_the_title():
    ax = draw_schedule(one_f_one_b(3, 4))
    assert _boxes(ax) == 3 * 2 * 4
    assert "bubble 0.333" in ax.get_title()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1", "stage 2"]
    plt.close(ax.figure)


def test_measured_timelines_draw_like_simulated_ones():
    sim = simulate(gpipe(2, 3), t_f=0.01, t_b=0.02)
    ax = draw_timeline(sim.timeline, title="measured", unit="s")
    assert _boxes(ax) == 12 and ax.get_title() == "measured"
    ax2 = draw_simulation(simulate(interleaved_1f1b(2, 4, 2)))
    assert "v=2" in ax2.get_title()
    plt.close("all")


@pytest.mark.parametrize("kind", ["naive", "gpipe", "1f1b", "interleaved", "zb-h1"])
def test_explore_every_schedule(kind, capsys):
    ax = explore(kind, p=3, m=5, v=2)
    out = capsys.readouterr().out
    assert f"{kind}: bubble" in out and "formula" in out
    assert _boxes(ax) > 0
    plt.close("all")


def test_the_explorer_redraws_when_a_control_changes(capsys):
    widget = explorer()
    capsys.readouterr()
    controls = {c.description: c for c in widget.children if hasattr(c, "description")}
    controls["p"].value = 2
    controls["kind"].value = "gpipe"
    out = capsys.readouterr().out
    assert "gpipe: bubble" in out
    assert widget.result is not None
    plt.close("all")
