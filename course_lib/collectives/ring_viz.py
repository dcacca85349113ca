"""Stepping through the ring all-reduce: which chunk each rank holds and sums.

The plan is data: :func:`ring_all_reduce_plan` lists, for each of the 2(K-1)
steps, which rank sends which chunk to whom, using the same
:func:`~course_lib.collectives.ring_step_chunks` as the real implementation.
:func:`simulate` replays it on sets of contributors, and :func:`draw_ring_step`
draws one step (a K x K grid: rank x chunk). In a notebook::

    ipywidgets.interact(lambda step: draw_ring_step(4, step),
                        step=ipywidgets.IntSlider(0, 0, 2 * 3))
"""
from __future__ import annotations

from course_lib.collectives.ring import ring_step_chunks


def ring_all_reduce_plan(world):
    """[{"step", "phase", "transfers": [(src, dst, chunk)]}] for all 2(K-1) steps."""
    plan = []
    for phase in ("reduce_scatter", "all_gather"):
        for s in range(world - 1):
            transfers = [(r, (r + 1) % world, ring_step_chunks(r, world, s, phase)[0])
                         for r in range(world)]
            plan.append({"step": len(plan), "phase": phase, "transfers": transfers})
    return plan


def simulate(world, steps):
    """holdings[rank][chunk] = frozenset of ranks whose data is summed into that
    chunk on that rank, after the first ``steps`` steps of the plan."""
    holdings = [[frozenset([r]) for _ in range(world)] for r in range(world)]
    for entry in ring_all_reduce_plan(world)[:steps]:
        sent = {(src, chunk): holdings[src][chunk] for src, _, chunk in entry["transfers"]}
        for src, dst, chunk in entry["transfers"]:
            if entry["phase"] == "reduce_scatter":
                holdings[dst][chunk] = holdings[dst][chunk] | sent[(src, chunk)]
            else:
                holdings[dst][chunk] = sent[(src, chunk)]
    return holdings


def _label(contributors, world):
    if len(contributors) == world:
        return "Σ all"
    return "+".join(str(r) for r in sorted(contributors))


def draw_ring_step(world, step, ax=None):
    """Draw the state *before* ``step`` runs (``step = 2(K-1)`` shows the end),
    with the chunks about to be sent outlined. Returns ax."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    total = 2 * (world - 1)
    if not 0 <= step <= total:
        raise ValueError(f"step must be in [0, {total}] for world size {world}")
    holdings = simulate(world, step)
    plan = ring_all_reduce_plan(world)
    sending = {(src, chunk) for src, _, chunk in plan[step]["transfers"]} if step < total else set()
    if ax is None:
        _, ax = plt.subplots(figsize=(1.3 * world + 1.5, 0.8 * world + 1.2))
    cmap = plt.get_cmap("Blues")
    for r in range(world):
        for c in range(world):
            share = len(holdings[r][c]) / world
            ax.add_patch(Rectangle((c, r), 1, 1, facecolor=cmap(0.15 + 0.75 * share),
                                   edgecolor="black", linewidth=0.5))
            ax.text(c + 0.5, r + 0.5, _label(holdings[r][c], world), ha="center", va="center",
                    fontsize=9, color="white" if share > 0.6 else "black")
            if (r, c) in sending:
                ax.add_patch(Rectangle((c + 0.04, r + 0.04), 0.92, 0.92, fill=False,
                                       edgecolor="#DD8452", linewidth=2.5))
    ax.set_xlim(0, world)
    ax.set_ylim(world, 0)
    ax.set_xticks([c + 0.5 for c in range(world)], [f"chunk {c}" for c in range(world)])
    ax.set_yticks([r + 0.5 for r in range(world)], [f"rank {r}" for r in range(world)])
    if step < total:
        phase = plan[step]["phase"].replace("_", "-")
        title = (f"step {step + 1} of {total} ({phase}): outlined chunks go to rank r+1"
                 + (", which adds its own" if plan[step]["phase"] == "reduce_scatter" else ""))
    else:
        title = f"done after {total} steps: every rank holds every chunk, fully summed"
    ax.set_title(title, fontsize=10)
    ax.set_aspect("equal")
    return ax
