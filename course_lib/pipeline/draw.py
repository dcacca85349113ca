"""Drawing schedules: simulated or measured, one row per stage, a box per action.

    draw_schedule(one_f_one_b(4, 8))                  # simulated, bubble in the title
    draw_timeline(measured_timeline(run(...).trace))  # the real run, same picture
    explorer()                                        # ipywidgets: any schedule, p, m, v

Forwards are blue, backwards green (W, the weight half of a split backward,
purple); the number in a box is the microbatch, a lighter shade a later chunk.
"""
from __future__ import annotations

from course_lib.pipeline.schedules import SCHEDULES, make_schedule
from course_lib.pipeline.simulate import bubble_fraction, simulate, zb_h1_bubble

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B3"}


def _shade(hex_color, chunk):
    if not chunk:
        return hex_color
    rgb = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = min(0.6, 0.3 * chunk)
    return tuple(c + (1 - c) * mix for c in rgb)


def draw_timeline(timeline, ax=None, title=None, unit=""):
    """Draw ``timeline[s] = [(action, start, end)]``; returns ax."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * max(1, len(timeline))))
    end = max((t1 for row in timeline for _, _, t1 in row), default=1.0)
    kinds = set()
    for s, row in enumerate(timeline):
        for action, t0, t1 in row:
            kind, mb = action[0], action[1]
            chunk = action[2] if len(action) > 2 else 0
            kinds.add(kind)
            ax.broken_barh([(t0, t1 - t0)], (s - 0.4, 0.8), facecolors=_shade(COLORS[kind], chunk),
                           edgecolor="black", linewidth=0.4)
            if (t1 - t0) > end / 120:
                ax.text((t0 + t1) / 2, s, str(mb), ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks(range(len(timeline)), [f"stage {s}" for s in range(len(timeline))])
    ax.set_ylim(len(timeline) - 0.5, -0.5)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel(f"time{f' ({unit})' if unit else ''}")
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in ("F", "B", "W") if k in kinds],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def draw_simulation(sim, ax=None, title=None, unit="t_f units"):
    """Draw a :class:`~course_lib.pipeline.simulate.Simulation`, its bubble in the title."""
    title = title or f"p={sim.p}, m={sim.m}" + (f", v={sim.v}" if sim.v > 1 else "")
    return draw_timeline(sim.timeline, ax, f"{title}: bubble {sim.bubble:.3f}", unit=unit)


def draw_schedule(schedule, t_f=1.0, t_b=2.0, t_comm=0.0, ax=None, title=None, unit="t_f units"):
    """Simulate ``schedule`` and draw it (``unit`` names the unit of t_f, t_b); returns ax."""
    return draw_simulation(simulate(schedule, t_f, t_b, t_comm), ax, title, unit)


def explore(kind="1f1b", p=4, m=8, v=2, t_b=2.0, t_comm=0.0, ax=None):
    """Draw schedule ``kind`` for (p, m, v) and print its bubble against (p-1)/(vm+p-1)."""
    import matplotlib.pyplot as plt

    if kind == "interleaved" and m % p:
        m = max(p, m - m % p)  # interleaving runs microbatches in groups of p
    v_used = v if kind == "interleaved" else 1
    schedule = make_schedule(kind, p, m, v_used)
    sim = simulate(schedule, 1.0, t_b, t_comm)
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.8 + 0.45 * p))
    m_shown = 1 if kind == "naive" else m
    draw_simulation(sim, ax, f"{kind}, p={p}, m={m_shown}" + (f", v={v}" if v_used > 1 else ""))
    if kind == "zb-h1":
        name, formula = "(p-1)(t_f+t_b-2t_w)/(m(t_f+t_b)+...), m >= p", zb_h1_bubble(p, m, 1.0, t_b,
                                                                                      t_b / 2)
    else:
        name, formula = "(p-1)/(vm+p-1)", bubble_fraction(p, m_shown, v_used)
    print(f"{kind}: bubble {sim.bubble:.3f} (formula {name} = {formula:.3f}), "
          f"makespan {sim.makespan:g}")
    return ax


def explorer():
    """An ipywidgets explorer of :func:`explore`: schedule, p, m, v, t_b, t_comm."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    def explore_and_show(**settings):
        ax = explore(**settings)
        # ipywidgets shows a callback's figures itself only for inline backends it knows by
        # name, and matplotlib 3.11 names its own 'inline': show it here, or the picture
        # under the widget never changes
        plt.show()
        return ax

    return widgets.interactive(
        explore_and_show, kind=widgets.Dropdown(options=list(SCHEDULES), value="1f1b"),
        p=widgets.IntSlider(4, 1, 8), m=widgets.IntSlider(8, 1, 24),
        v=widgets.IntSlider(2, 1, 4), t_b=widgets.FloatSlider(2.0, min=0.5, max=4.0, step=0.5),
        t_comm=widgets.FloatSlider(0.0, min=0.0, max=1.0, step=0.1), ax=widgets.fixed(None))
