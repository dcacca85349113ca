"""Drawing traces: a Gantt chart with one row per rank and a colour per category."""
from __future__ import annotations

from course_lib.trace.timeline import lanes_of

COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "idle": "#BBBBBB",
          "memory": "#55A868", "other": "#8172B3"}


def gantt(trace, ax=None, title=None, label_microbatches=True, unit="ms"):
    """Draw ``trace`` on ``ax`` (a new figure if None). Each rank gets one row,
    split into sub-rows where spans overlap (async communication). Returns ax."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.7 + 0.6 * max(1, len(trace.ranks))))
    yticks, ylabels, seen = [], [], set()
    for row, rank in enumerate(trace.ranks):
        lanes = lanes_of(trace.select(rank=rank))
        height = 0.8 / max(1, len(lanes))
        for i, (_, _, spans) in enumerate(lanes):
            y = row - 0.4 + i * height
            for s in spans:
                color = COLORS.get(s.cat, "#937860")
                seen.add(s.cat)
                ax.broken_barh([(s.start * scale, s.duration * scale)], (y, height * 0.9),
                               facecolors=color, edgecolor="black", linewidth=0.3)
                if label_microbatches and s.microbatch is not None:
                    ax.text((s.start + s.duration / 2) * scale, y + height * 0.45, str(s.microbatch),
                            ha="center", va="center", fontsize=7, color="white")
        yticks.append(row)
        ylabels.append(f"rank {rank}")
    ax.set_yticks(yticks, ylabels)
    ax.set_ylim(len(trace.ranks) - 0.5, -0.5)
    ax.set_xlabel(f"time since t0 ({unit})")
    ax.legend(handles=[Patch(color=COLORS.get(c, "#937860"), label=c) for c in sorted(seen)],
              loc="upper right", fontsize=8)
    if title:
        ax.set_title(title)
    return ax
