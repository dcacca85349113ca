"""The course GPT on four dims at once: DP x CP x TP x PP (Lab 06, with Lab 07's ring).

On ``dp * cp * tp * pp`` ranks laid out with tp fastest, then cp, then dp, then pp:

    global rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

rank (pp_i, dp_i, cp_i, tp_i) does what DP x TP x PP's rank (pp_i, dp_i, tp_i) does
(:mod:`~course_lib.hybrid.three_d`) on chunk cp_i of every sequence:

- its stage's attention runs the ring of Lab 07 over its cp group, on its tp rank's
  H/t heads (``ParallelAttention.attend``): each query sees every earlier key, wherever
  it lives; everything else in a block works token by token;
- the first stage embeds its chunk at the chunk's positions, the last stage's loss is
  the mean over its chunk's tokens; the chunks are equal, so the mean of the cp ranks'
  means is the replica's mean;
- the stage averages its gradients over the dp x cp ranks that hold the same weights
  (same pp_i and tp_i). A cp rank's loss is its chunk's mean, but its gradient also
  carries the later chunks' queries' share, which the ring's backward brings home with
  each block's dK, dV: the cp ranks' gradients sum to c times the replica's, and the
  average over dp x cp is the batch's mean.

Why cp between tp and dp: the ring's messages are smaller than tp's (2 b (s/c) h / t
elements against b s h) and overlap attention's compute, while tp's all-reduces block
every layer; dp's come once a step.
Sixteen ranks as (pp, dp, cp, tp) = (2, 2, 2, 2) train like one process::

    out = run(train_strategy, "dp_cp_tp_pp", cfg, dp=2, inner=8, tp=2, cp=2, nproc=16)
"""
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch.distributed as dist

LAYOUT = ("pp", "dp", "cp", "tp")  # slowest to fastest


class Coords4(NamedTuple):
    pp: int
    dp: int
    cp: int
    tp: int


class FourDims:
    """Sizes of the four dims and, after :meth:`build`, this rank's groups: one per dim,
    and ``"dp_cp"`` (the ranks holding the same weights). Arithmetic needs no processes::

        FourDims(dp=2, cp=2, tp=2, pp=2).group_ranks(("cp",), 5)   # [5, 7]
    """

    def __init__(self, dp=1, cp=1, tp=1, pp=1):
        self.sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        for name, size in self.sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name} must be a positive integer, got {size!r}")
        self.world_size = pp * dp * cp * tp
        self._groups = {}

    def coords_of(self, rank):
        """(pp, dp, cp, tp) of ``rank``: peel off tp (fastest), then cp, dp, pp."""
        coords = []
        for name in reversed(LAYOUT):
            rank, here = divmod(rank, self.sizes[name])
            coords.append(here)
        return Coords4(*reversed(coords))

    def rank_of(self, coords):
        rank = 0
        for name, value in zip(LAYOUT, coords):
            rank = rank * self.sizes[name] + value
        return rank

    def group_ranks(self, dims, rank):
        """Global ranks that share ``rank``'s coordinates outside ``dims``, in group-local
        order (the dims' coordinates counted with the last of ``dims`` fastest)."""
        here = self.coords_of(rank)._asdict()
        ranks = []
        for values in itertools.product(*(range(self.sizes[d]) for d in dims)):
            ranks.append(self.rank_of(Coords4(**{**here, **dict(zip(dims, values))})))
        return ranks

    GROUPS = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp_cp": ("dp", "cp")}

    def build(self):
        """Make every group, on every rank, in one order (``new_group`` is collective)."""
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"pp*dp*cp*tp = {self.world_size}, but the world size is "
                             f"{dist.get_world_size()}")
        me = dist.get_rank()
        for name, dims in self.GROUPS.items():
            every = sorted({tuple(self.group_ranks(dims, r)) for r in range(self.world_size)})
            for ranks in every:
                group = dist.new_group(list(ranks))
                if me in ranks:
                    self._groups[name] = group
        self.coords = self.coords_of(me)
        return self

    def group(self, name):
        return self._groups[name]

    def destroy(self):
        for group in self._groups.values():
            dist.destroy_process_group(group)
        self._groups = {}


def dp_cp_tp_pp(cfg, dp, inner, seed, lr, microbatches, schedule, collectives, tp=2, cp=2, **_):
    """The ``"dp_cp_tp_pp"`` strategy of :func:`~course_lib.hybrid.strategies.build`:
    ``inner`` = cp x tp x pp ranks per replica, the sequence cut into cp equal chunks."""
    from course_lib.cp.ring_attention import ring_attention
    from course_lib.hybrid.strategies import pipeline_run
    from course_lib.hybrid.three_d import stage_on_mesh, tp_dense_state
    from course_lib.pipeline import make_schedule

    if inner % (cp * tp):
        raise ValueError(f"DP x CP x TP x PP: inner = {inner} ranks per replica is not a "
                         f"multiple of cp x tp = {cp * tp}")
    if cfg.seq_len % cp:
        raise ValueError(f"seq_len = {cfg.seq_len} does not cut into cp = {cp} equal chunks")
    pp, chunk = inner // (cp * tp), cfg.seq_len // cp
    dims = FourDims(dp=dp, cp=cp, tp=tp, pp=pp).build()
    c = dims.coords.cp
    attend = functools.partial(ring_attention, group=dims.group("cp"), causal=True)
    # the first stage embeds its chunk where it sits; the weights are shared over dp x cp
    ddp, stage, opt = stage_on_mesh(cfg, dims.coords.pp, pp, seed, lr, dims.group("tp"),
                                    dims.group("dp_cp"), dims.group("pp"), collectives,
                                    attend=attend, pos_offset=c * chunk)
    # every cp rank of the last stage's first tp rank reports its chunk's mean
    run = pipeline_run("dp_cp_tp_pp", dims, ddp, stage, opt, make_schedule(schedule, pp,
                                                                           microbatches),
                       cfg, dp, stage.is_last and dims.coords.tp == 0,
                       lambda: {n: t.cpu() for n, t in tp_dense_state(ddp.module).items()})
    rows_of_replica, step = run.rows, run.step
    run.rows = lambda batch: rows_of_replica(batch)[:, c * chunk:(c + 1) * chunk]
    run.step = lambda x, y: step(x, y) / cp  # the cp chunks' means, summed, over cp
    return run
