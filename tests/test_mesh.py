"""ParallelDims: the arithmetic against an independent grid, and build() under real
torchrun on gloo agreeing with it, its groups carrying real collectives."""
import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import run
from course_lib.mesh import DIMS, ParallelDims

ship_by_value(__name__)

SHAPES = [dict(dp=3, tp=2), dict(pp=1, dp=3, tp=2), dict(pp=3, dp=1, tp=2), dict(pp=2, dp=2, tp=2),
          dict(pp=2, dp=3, tp=1), dict(dp=5), dict(pp=3, dp=2, tp=3), dict()]


def reference_grid(dims):
    """Independent reference: ranks 0..W-1 reshaped row-major into (pp, dp, tp),
    so the last dim (tp) varies fastest."""
    return torch.arange(dims.world_size).reshape(dims.pp, dims.dp, dims.tp)


def reference_group(grid, coords, name):
    index = [coords.pp, coords.dp, coords.tp]
    index[DIMS.index(name)] = slice(None)
    return grid[tuple(index)].tolist()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()) or "1")
def test_coords_and_groups_match_a_reshaped_grid(shape):
    dims = ParallelDims(**shape)
    grid = reference_grid(dims)
    for rank in range(dims.world_size):
        coords = dims.coords_of(rank)
        assert grid[coords.pp, coords.dp, coords.tp].item() == rank
        assert dims.rank_of(**coords._asdict()) == rank
        assert rank == (coords.pp * dims.dp + coords.dp) * dims.tp + coords.tp
        for name in DIMS:
            group = dims.group_ranks(name, rank)
            assert group == reference_group(grid, coords, name)
            assert group[getattr(coords, name)] == rank  # group-local rank = coordinate
    for name in DIMS:  # each dim's groups partition the world into groups of its size
        groups = dims.all_groups(name)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
        assert {len(g) for g in groups} == {getattr(dims, name)}
        assert len(groups) == dims.world_size // getattr(dims, name)


def test_the_docstring_picture_of_eight_ranks():
    dims = ParallelDims(pp=2, dp=2, tp=2)
    assert dims.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.all_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.all_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.coords_of(6) == (1, 1, 0) and dims.coords_of(6).dp == 1


def test_validate_gives_the_exact_message():
    with pytest.raises(ValueError) as info:
        ParallelDims(dp=2, tp=3).validate(4)
    assert str(info.value) == "dp*pp*tp = 6, but the world size is 4"
    ParallelDims(dp=2, tp=3).validate(6)  # the right size passes


@pytest.mark.parametrize("bad", [dict(dp=0), dict(tp=-2), dict(pp=1.5), dict(dp=True), dict(tp="2")])
def test_non_positive_or_non_integer_dims_are_refused(bad):
    (name, value), = bad.items()
    with pytest.raises(ValueError, match=f"^{name} must be a positive integer, got {value!r}$"):
        ParallelDims(**bad)


def test_bad_names_and_ranks_are_refused():
    dims = ParallelDims(dp=2, tp=3)
    with pytest.raises(ValueError, match="unknown dim 'ep'"):
        dims.group_ranks("ep", 0)
    with pytest.raises(ValueError, match="rank 6 is outside 0..5"):
        dims.coords_of(6)
    with pytest.raises(ValueError, match="tp=3 is outside 0..2"):
        dims.rank_of(tp=3)
    with pytest.raises(RuntimeError, match="build"):
        dims.group("tp")  # not built: no process group here


def build_each(shapes):
    """On every rank: build each layout, record what the mesh says and what an
    all-reduce of the global rank over each dim's group gives, then destroy it."""
    rank = dist.get_rank()
    try:
        ParallelDims(dp=2, tp=dist.get_world_size()).build()
        wrong_size = None
    except ValueError as e:  # refused before any group is made: nothing to undo
        wrong_size = str(e)
    seen = []
    for shape in shapes:
        dims = ParallelDims(**shape).build()
        record = {"coords": tuple(dims.coords), "ranks": {}, "sums": {}, "local": {},
                  "size": {}}
        for name in DIMS:
            group = dims.group(name)
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=group)
            record["ranks"][name] = dims.ranks(name)
            record["sums"][name] = total.item()
            record["local"][name] = dist.get_rank(group)
            record["size"][name] = dist.get_world_size(group)
        dims.destroy()
        seen.append(record)
    dist.barrier()  # the default group survives every destroy()
    return {"wrong_size": wrong_size, "seen": seen}


@pytest.mark.parametrize("world, shapes", [
    (4, [dict(dp=2, tp=2), dict(pp=2, dp=2), dict(tp=4)]),
    pytest.param(6, [dict(dp=2, tp=3), dict(dp=3, tp=2), dict(pp=3, tp=2)],
                 marks=pytest.mark.slow),  # 6 ranks on 2 cores: `make test-slow`
], ids=["4 ranks", "6 ranks"])
def test_build_agrees_with_the_arithmetic_and_its_groups_reduce(world, shapes):
    out = run(build_each, shapes, nproc=world, backend="gloo", timeout=180)
    for rank, result in enumerate(out):
        assert result["wrong_size"] == f"dp*pp*tp = {2 * world}, but the world size is {world}"
        for shape, record in zip(shapes, result["seen"], strict=True):
            dims = ParallelDims(**shape)
            where = f"rank {rank} in {dims}"
            assert record["coords"] == tuple(dims.coords_of(rank)), where
            for name in DIMS:
                expected = dims.group_ranks(name, rank)
                assert record["ranks"][name] == expected, f"{where}, dim {name}"
                assert record["sums"][name] == float(sum(expected)), f"{where}, dim {name}"
                assert record["local"][name] == getattr(dims.coords_of(rank), name), where
                assert record["size"][name] == getattr(dims, name), where
