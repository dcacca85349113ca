"""Sharded save and resharding load on real gloo ranks: saved as flat ranges on 4 ranks
(FSDP's layout), loaded as rows on 2, columns on 3 and whole in one process; each rank
reads exactly the bytes of its boxes; replicated tensors are written once; a save killed
after a rank's data leaves the previous checkpoint the latest; bad requests name the
checkpoint, the tensor and what differs."""
import math
import os
import signal

import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import run
from course_lib.checkpoint import (CheckpointError, ShardedTensor, boxes_of_flat_range,
                                   consolidate, latest, load, save)
from course_lib.runtime.launcher import LaunchError

ship_by_value(__name__)

SHAPES = {"w": (7, 5), "b": (11,), "e": (3, 4, 2)}  # no size divides evenly by 2, 3 or 4


def full(name, dtype=torch.float32):
    gen = torch.Generator(device="cpu").manual_seed(len(name) * 7 + sum(map(ord, name)))
    return torch.randn(*SHAPES[name], generator=gen, device="cpu").to(dtype)


def flat_range(numel, rank, world):
    """FSDP's shard: ceil(numel / world) elements per rank, the last ones short or empty."""
    per = math.ceil(numel / world)
    start = min(rank * per, numel)
    return start, min(per, numel - start)


def fsdp_state(step=3):
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"step": step, "losses": [2.5, 2.25], "replicated": full("b") * 10}
    for name in SHAPES:
        whole = full(name)
        start, length = flat_range(whole.numel(), rank, world)
        state[name] = [ShardedTensor(whole[tuple(slice(o, o + z) for o, z in zip(*box))].clone(),
                                     whole.shape, box[0])
                       for box in boxes_of_flat_range(whole.shape, start, length)] or \
            [ShardedTensor(torch.empty((0,) * whole.dim()), whole.shape, (0,) * whole.dim())]
    return state


def save_fsdp(path, kill_rank=None):
    def on_stage(stage):
        if stage == "data" and dist.get_rank() == kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    return save(fsdp_state(), path, on_stage=on_stage)


def load_split(path, dim):
    """Every tensor split along ``dim`` (the last one for 1-D) in uneven blocks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"step": None, "losses": None, "replicated": torch.zeros(SHAPES["b"])}
    for name, shape in SHAPES.items():
        d = min(dim, len(shape) - 1)
        sizes = [len(c) for c in torch.arange(shape[d]).tensor_split(world)]
        offsets = [0] * len(shape)
        offsets[d] = sum(sizes[:rank])
        local = list(shape)
        local[d] = sizes[rank]
        state[name] = ShardedTensor(torch.full(local, float("nan")), shape, tuple(offsets))
    read = load(state, path)
    mine = sum(s.local.numel() * 4 for k, s in state.items() if isinstance(s, ShardedTensor))
    return ({k: (v.local, v.offsets) if isinstance(v, ShardedTensor) else v
             for k, v in state.items()}, read, mine + state["replicated"].numel() * 4)


def test_saved_as_flat_ranges_on_4_loads_as_rows_columns_and_whole(tmp_path):
    path = tmp_path / "step_000003"
    written = run(save_fsdp, path, nproc=4, timeout=120)
    state_bytes = sum(full(n).numel() * 4 for n in SHAPES) + full("b").numel() * 4
    assert sum(written) == state_bytes  # no duplicates: the replicated tensor once
    for world, dim in ((2, 0), (3, 1), (1, 0)):
        for got, read, mine in run(load_split, path, dim, nproc=world, timeout=120):
            assert read == mine  # exactly the bytes of this rank's boxes
            assert got["step"] == 3 and got["losses"] == [2.5, 2.25]
            assert torch.equal(got["replicated"], full("b") * 10)
            for name in SHAPES:
                local, offsets = got[name]
                box = tuple(slice(o, o + z) for o, z in zip(offsets, local.shape))
                assert torch.equal(local, full(name)[box]), (world, dim, name)
    whole = consolidate(path)
    assert all(torch.equal(whole[n], full(n)) for n in SHAPES)
    assert whole["step"] == 3 and latest(tmp_path) == path


def test_a_save_killed_after_a_rank_s_data_leaves_the_last_checkpoint(tmp_path):
    run(save_fsdp, tmp_path / "step_000003", nproc=2, timeout=120)
    with pytest.raises(LaunchError):
        run(save_fsdp, tmp_path / "step_000004", 1, nproc=2, timeout=120)
    assert latest(tmp_path) == tmp_path / "step_000003"
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        consolidate(tmp_path / "step_000004")
    assert torch.equal(consolidate(tmp_path / "step_000003")["w"], full("w"))
    # the dead save's directory can be saved into again, and then commits
    run(save_fsdp, tmp_path / "step_000004", nproc=3, timeout=120)
    assert latest(tmp_path) == tmp_path / "step_000004"
    with pytest.raises(LaunchError, match="never overwrites"):
        run(save_fsdp, tmp_path / "step_000004", nproc=2, timeout=120)


def test_bad_requests_name_the_checkpoint_the_tensor_and_what_differs(tmp_path):
    run(save_fsdp, tmp_path / "step_1", nproc=2, timeout=120)
    path = tmp_path / "step_1"
    with pytest.raises(CheckpointError, match=r"holds no tensor 'missing'"):
        load({"missing": torch.zeros(3)}, path)
    with pytest.raises(CheckpointError, match=r"'w' was saved with shape \(7, 5\), the state "
                                              r"asks for \(5, 7\)"):
        load({"w": torch.zeros(5, 7)}, path)
    with pytest.raises(CheckpointError, match="'b' was saved as torch.float32, the state "
                                              "holds torch.float64"):
        load({"b": torch.zeros(11, dtype=torch.float64)}, path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load({"w": torch.zeros(7, 5)}, tmp_path / "nowhere")
    assert latest(tmp_path / "nowhere") is None


def load_and_die(path):
    state = {"w": torch.zeros(SHAPES["w"]), "b": torch.zeros(SHAPES["b"])}
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a rank ended in the middle of a load
    load(state, path)
    return True


def test_a_load_killed_on_a_rank_leaves_the_checkpoint_loadable(tmp_path):
    path = tmp_path / "step_000001"
    run(save_fsdp, path, nproc=2, timeout=120)
    before = sorted((p.name, p.stat().st_size) for p in path.iterdir())
    with pytest.raises(LaunchError):
        run(load_and_die, path, nproc=2, timeout=120)
    assert sorted((p.name, p.stat().st_size) for p in path.iterdir()) == before
    assert torch.equal(consolidate(path)["w"], full("w"))
