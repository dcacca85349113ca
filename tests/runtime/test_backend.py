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
