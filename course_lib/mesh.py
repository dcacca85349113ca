"""ParallelDims: the world's ranks arranged as a 3-D grid (pp, dp, tp) on a DeviceMesh.

Data, pipeline and tensor parallelism combine by giving every rank a coordinate
(pp_i, dp_i, tp_i) with 0 <= pp_i < pp, 0 <= dp_i < dp, 0 <= tp_i < tp, so that
dp * pp * tp = world size. The ranks that share two coordinates and differ in the
third form one group along that third dim: a tp group runs the tensor-parallel
all-reduces, a dp group averages gradients, and neighbours in a pp group pass
activations forward and gradients back.

The grid is laid out with tp varying fastest, then dp, then pp (the order of
Megatron-LM and torchtitan):

    global rank = (pp_i * dp + dp_i) * tp + tp_i

Eight ranks as pp=2, dp=2, tp=2::

                 dp_i=0      dp_i=1
                tp 0   1    tp 0   1
    pp_i=0  :  [ 0 ,  1 ]  [ 2 ,  3 ]      node A
    pp_i=1  :  [ 4 ,  5 ]  [ 6 ,  7 ]      node B

    tp groups: {0,1} {2,3} {4,5} {6,7}     neighbours
    dp groups: {0,2} {1,3} {4,6} {5,7}     stride tp
    pp groups: {0,4} {1,5} {2,6} {3,7}     stride dp*tp

Why tp fastest: tensor parallelism communicates inside every layer, twice
forward and twice backward, on the critical path; data parallelism once per
step and overlapped with backward; pipelining only activations at stage edges.
Consecutive ranks usually share a node (torchrun numbers a node's GPUs
together), so giving tp the neighbouring ranks puts the chattiest traffic on
the fastest links (NVLink) and lets dp and pp cross the slower network.

    dims = ParallelDims(dp=2, tp=2)
    dims.validate(4)                        # before launching
    dims.coords_of(3), dims.group_ranks("dp", 3)   # arithmetic only: (0, 1, 1), [1, 3]
    # on every rank of a 4-rank job:
    dims.build()
    dist.all_reduce(t, group=dims.group("tp"))
    dims.coords, dims.ranks("dp")
    dims.destroy()                          # frees the sub-groups it made
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DIMS = ("pp", "dp", "tp")  # slowest to fastest


class Coords(NamedTuple):
    pp: int
    dp: int
    tp: int


@dataclass
class ParallelDims:
    """Sizes of the data, pipeline and tensor parallel dims. The arithmetic
    (rank_of, coords_of, group_ranks, all_groups) needs no processes; build()
    makes the real DeviceMesh, kept as ``.mesh``, for group/ranks/coords."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in DIMS:
            value = getattr(self, name)
            try:
                size = None if isinstance(value, bool) else operator.index(value)
            except TypeError:
                size = None
            if size is None or size < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            setattr(self, name, size)

    # -- arithmetic: no processes needed -------------------------------------------

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def shape(self) -> tuple[int, int, int]:
        """The mesh shape in layout order (pp, dp, tp)."""
        return self.pp, self.dp, self.tp

    def validate(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(f"dp*pp*tp = {self.world_size}, but the world size is {world_size}")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1} for {self}")

    @staticmethod
    def _check_dim(name: str) -> None:
        if name not in DIMS:
            raise ValueError(f"unknown dim {name!r}; the dims are {', '.join(DIMS)}")

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """Global rank at coordinates (pp, dp, tp): (pp*dp_size + dp)*tp_size + tp."""
        for name, value in zip(DIMS, (pp, dp, tp)):
            if not 0 <= value < getattr(self, name):
                raise ValueError(f"{name}={value} is outside 0..{getattr(self, name) - 1}")
        return (pp * self.dp + dp) * self.tp + tp

    def coords_of(self, rank: int) -> Coords:
        """The inverse of :meth:`rank_of`: peel off tp (fastest), then dp, then pp."""
        self._check_rank(rank)
        rest, tp = divmod(rank, self.tp)
        pp, dp = divmod(rest, self.dp)
        return Coords(pp=pp, dp=dp, tp=tp)

    def group_ranks(self, name: str, rank: int) -> list[int]:
        """Global ranks of `rank`'s group along dim `name`, in group-local order
        (the group-local rank of each is its coordinate along `name`)."""
        self._check_dim(name)
        here = self.coords_of(rank)._asdict()
        return [self.rank_of(**{**here, name: i}) for i in range(getattr(self, name))]

    def all_groups(self, name: str) -> list[list[int]]:
        """Every group along dim `name`, each as :meth:`group_ranks` gives it,
        ordered by their lowest rank."""
        self._check_dim(name)
        groups = {tuple(self.group_ranks(name, r)) for r in range(self.world_size)}
        return [list(g) for g in sorted(groups)]

    # -- the real mesh: every rank, inside an initialised process group -------------

    def build(self, device_type: str | None = None) -> ParallelDims:
        """Make the DeviceMesh and its groups; call on every rank, in the same
        order as any other group creation (torch creates each dim's groups with
        ``new_group``, which every rank must call). Returns self.

        device_type defaults to the job's (:func:`~course_lib.runtime.backend.device_mesh`):
        "cuda" when the default group runs NCCL, else "cpu", whatever GPU the process sees."""
        if self.mesh is not None:
            raise RuntimeError("this ParallelDims is already built; destroy() it first")
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build() needs an initialised process group "
                               "(run it on the ranks, e.g. inside course_lib.run)")
        self.validate(dist.get_world_size())
        if device_type is None:
            from course_lib.runtime.backend import device_mesh

            self.mesh = device_mesh(self.shape(), DIMS)
        else:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(device_type, self.shape(), mesh_dim_names=DIMS)
        return self

    def _built(self):
        if self.mesh is None:
            raise RuntimeError("call build() on every rank first")
        return self.mesh

    def group(self, name: str) -> dist.ProcessGroup:
        """This rank's process group along dim `name` (pass it as ``group=``)."""
        self._check_dim(name)
        return self._built().get_group(name)

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group along dim `name`, in group-local order."""
        return dist.get_process_group_ranks(self.group(name))

    @property
    def coords(self) -> Coords:
        """This rank's coordinates, as the mesh sees them."""
        return Coords(*self._built().get_coordinate())

    def destroy(self) -> None:
        """Free the sub-groups this mesh made (never the default group), so a
        job can build another layout. Call on every rank."""
        mesh, self.mesh = self._built(), None
        world = dist.group.WORLD
        for name in DIMS:
            pg = mesh.get_group(name)
            if pg is not world:
                dist.destroy_process_group(pg)
