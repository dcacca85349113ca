"""The context-parallel benchmark on tiny shapes: the variants agree with dense before
they are timed, torch's column says why it cannot run where it cannot, the traced
spans show contiguous ranks doing unequal work and zigzag ranks equal work, and the
memory rows equal the formula. No assertion on time."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import ship_by_value
from course_lib import run
from course_lib.bench import cp as bcp

ship_by_value(__name__)


def test_blocks_computed_contiguous_staircase_and_zigzag_flat():
    for n in (1, 2, 3, 4):
        assert [bcp.blocks_computed(r, n, "contiguous") for r in range(n)] == list(range(1, n + 1))
        assert [bcp.blocks_computed(r, n, "zigzag") for r in range(n)] == [n] * n


def test_measure_checks_every_variant_against_dense():
    result = run(bcp.measure, batch=1, heads=2, seq=24, head_dim=8, steps=1, rounds=1, nproc=2,
                 timeout=120)
    assert result[0] == result[1]  # every rank reports the slowest rank's view
    res = result[0]
    assert res["max_diff"]["zigzag"] < 1e-5 and res["max_diff"]["contiguous"] < 1e-5
    assert {"zigzag", "contiguous", "dense"} <= set(res["step_s"])
    if "torch" in res["step_s"]:
        assert res["max_diff"]["torch"] < 1e-5 and res["torch_error"] is None
    else:  # the CPU: no sharding rule for the CPU flash kernel (see the module docstring)
        assert "flash_attention_for_cpu" in res["torch_error"]
    table = bcp.format_table(res, 2)
    assert "ours (zigzag) / dense" in table and "ours, ring (contiguous)" in table


def test_imbalance_contiguous_last_rank_does_most_zigzag_even():
    work = bcp.imbalance(nproc=3, batch=1, heads=2, seq=48, head_dim=8, timeout=120)
    contiguous, zigzag = work["contiguous"], work["zigzag"]
    assert [w["blocks"] for w in contiguous] == [1, 2, 3]
    assert [w["backward_blocks"] for w in contiguous] == [1, 2, 3]
    assert [w["blocks"] for w in zigzag] == [3, 3, 3]
    # 48 tokens: 16 per rank, a block is 16 x 16 scores per (batch, head)
    assert [w["scores"] for w in contiguous] == [256, 512, 768]
    # zigzag: 3/4 of its own block and half of each other block, (2n+1)/4 of a block
    assert [w["scores"] for w in zigzag] == [448, 448, 448]
    assert all(w["forward_s"] > 0 and w["backward_s"] > 0 for w in contiguous + zigzag)


def test_traced_step_puts_the_exchanges_in_the_comm_lane():
    res = run(bcp.traced_step, 1, 2, 16, 8, "contiguous", nproc=2, timeout=120)
    assert list(res) == [1, 2]
    for rank in (0, 1):
        comm = res.trace.select(rank=rank, cat="comm")
        # forward: one k/v pass; backward: the block ahead, its gradient behind, then home
        assert len(comm) == 4 and all(s.name.startswith("exchange") for s in comm)
        # each pass of the block is posted before the block it overlaps starts computing
        compute = res.trace.select(rank=rank, cat="compute")
        for prefix, nth in (("attention block ", 0), ("attention backward block ", 1)):
            first = min(s.start for s in compute if s.name.startswith(prefix))
            assert sorted(s.start for s in comm)[nth] <= first


def test_memory_rows_equal_the_formula():
    rows = bcp.memory(cps=(1, 2), batch=2, seq=32, dim=16, heads=2)
    assert [r["cp"] for r in rows] == [1, 2]
    for r in rows:
        assert r["per_rank"] == [r["formula"]] * r["cp"]
        assert r["dense_fused"] == r["dense_fused_formula"]
        assert r["dense_math"] == r["dense_math_formula"]
    assert rows[0]["formula"] == 2 * rows[1]["formula"]
    table = bcp.format_table({"step_s": {"zigzag": 1.0, "contiguous": 1.0, "dense": 1.0},
                              "max_diff": {}, "torch_error": "x", "shape": {
                                  "batch": 2, "heads": 2, "seq": 32, "head_dim": 8}}, 2,
                             memory_rows=rows)
    assert "cp = 2" in table and "!=" not in table


@pytest.mark.slow
def test_cli_prints_the_table(tmp_path):
    out = tmp_path / "cp.json"
    proc = subprocess.run([sys.executable, "-m", "course_lib.bench", "cp", "--nproc", "2",
                           "--seq", "32", "--dim", "16", "--heads", "2", "--rounds", "1",
                           "--steps", "1", "--mem-seq", "32", "--mem-cps", "1,2", "--json",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [w["blocks"] for w in result["imbalance"]["contiguous"]] == [1, 2]
    assert "ratios:" in proc.stdout and "cp = 2" in proc.stdout
    assert torch.tensor([r["measured"] == r["formula"] for r in result["memory"]]).all()
