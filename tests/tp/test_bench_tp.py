"""The tensor-parallel benchmark end to end (tiny sizes): shape of its output, never time."""
import pytest

from conftest import run_bench


@pytest.mark.slow
def test_tp_benchmark_compares_ours_torch_and_dense_in_one_job(tmp_path):
    proc, result = run_bench(tmp_path, "tp", "--nproc", 2, "--dim", 16, "--heads", 4,
                             "--seq", 6, "--batch", 3, "--steps", 1, "--rounds", 1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(result["step_s"]) == {"ours", "torch", "dense"}
    assert all(v > 0 for v in result["step_s"].values())
    assert all(diff < 1e-5 for diff in result["max_diff"].values())  # all three agree
    assert result["collectives"]["ours"] == {"all_reduce": 4}
    assert result["collectives"]["torch"] == {"all_reduce": 4}
    assert "ratio ours / torch" in proc.stdout
