import pytest
import torch

from course_lib import run
from course_lib.runtime.backend import SUPPORT_COLUMNS, SUPPORT_TABLE, probe_ops, resolve_backend


def test_auto_picks_gloo_without_enough_gpus():
    want = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    assert resolve_backend("auto", 2) == want
    assert resolve_backend("gloo", 3) == "gloo"


@pytest.mark.parametrize("backend,match", [("nccl", "NCCL|GPU"), ("tcp", "unknown backend")])
def test_impossible_backends_are_refused(backend, match):
    if backend == "nccl" and torch.cuda.device_count() >= 128:
        pytest.skip("a machine with 128 GPUs")
    with pytest.raises(ValueError, match=match):
        resolve_backend(backend, 128)


def test_support_table_is_rectangular_and_probe_covers_it():
    assert all(len(row) == len(SUPPORT_COLUMNS) for row in SUPPORT_TABLE.values())
    probed = run(probe_ops, nproc=2)
    assert probed[0].keys() == SUPPORT_TABLE.keys()
    assert probed[0]["send"] == probed[0]["all_reduce"] == "yes"  # gloo's basics
    assert probed[0] == probed[1]


@pytest.mark.parametrize("asked", ["auto", "nccl"])
def test_a_multi_node_job_counts_the_gpus_of_its_own_node(monkeypatch, asked):
    """cluster/torchrun.sbatch on 2 nodes x 4 GPUs: torchrun gives each rank
    WORLD_SIZE=8 and LOCAL_WORLD_SIZE=4; 4 GPUs on this node are enough."""
    from course_lib.runtime import backend

    monkeypatch.setattr(backend, "gpu_count", lambda: 4)
    monkeypatch.setattr(backend.dist, "is_nccl_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("COURSE_BACKEND", "nccl")
    assert backend.node_backend(asked) == "nccl"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")  # more ranks on this node than GPUs
    with pytest.raises(ValueError, match="one GPU per rank"):
        backend.node_backend(asked)


@pytest.mark.parametrize("gpus,nproc,backend,want", [
    (1, 2, "nccl", "gloo"),  # one GPU: the two-rank demos of a lab run on CPU ranks
    (2, 2, "nccl", "nccl"),
    (1, 2, "auto", "auto"),  # the launcher resolves "auto" itself
    (0, 4, "gloo", "gloo"),
])
def test_a_cell_that_needs_more_gpus_than_the_node_has_runs_on_gloo(monkeypatch, capsys,
                                                                    gpus, nproc, backend, want):
    from course_lib.runtime import backend as module

    monkeypatch.setattr(module, "gpu_count", lambda: gpus)
    assert module.backend_for(nproc, backend) == want
    assert ("runs on gloo" in capsys.readouterr().out) == (want != backend)


def test_a_demo_that_needs_two_ranks_gets_two_when_the_lab_runs_on_one(monkeypatch, capsys):
    from course_lib.runtime import backend as module

    monkeypatch.setattr(module, "gpu_count", lambda: 1)
    assert module.enough_ranks(2, 1, "nccl") == (2, "gloo")
    assert "needs 2 ranks and NPROC=1" in capsys.readouterr().out
    assert module.enough_ranks(2, 3, "gloo") == (3, "gloo")
    assert capsys.readouterr().out == ""
