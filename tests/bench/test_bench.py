"""Benchmarks run end to end (tiny sizes); no assertion on time, only on shape."""
import json
import subprocess
import sys

import pytest

from course_lib.bench import collectives as bc
from course_lib.bench.launch import bench_launch, format_launch


def test_size_parsing_and_ranges():
    assert bc.parse_size("4K") == 4096 and bc.parse_size("64M") == 64 << 20
    assert bc.parse_size("1.5kb") == 1536 and bc.parse_size("100") == 100
    assert bc.size_range("4K:64K") == [4096, 16384, 65536]
    assert bc.size_range("1M", factor=2) == [1 << 20]


@pytest.mark.slow
def test_collectives_benchmark_table_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "course_lib.bench", "collectives", "--nproc", "3",
                           "--sizes", "4K:16K", "--ops", "all_reduce,reduce_scatter,all_gather,"
                           "broadcast,naive_all_reduce,pipelined_broadcast", "--target-s", "0.02",
                           "--warmup", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 6
    for row in rows:
        assert row["nproc"] == 3 and row["ours"]["time_s"] > 0 and row["torch"]["time_s"] > 0
        factor = {"all_reduce": 4 / 3, "naive_all_reduce": 4 / 3, "reduce_scatter": 2 / 3,
                  "all_gather": 2 / 3}.get(row["op"], 1.0)
        assert row["ours"]["busbw"] == pytest.approx(row["ours"]["algbw"] * factor)
        assert row["ratio"] == pytest.approx(row["ours"]["busbw"] / row["torch"]["busbw"])
    assert "ratio" in proc.stdout and "all_reduce" in proc.stdout


def test_unknown_op_is_refused():
    proc = subprocess.run([sys.executable, "-m", "course_lib.bench", "collectives", "--ops", "gossip"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown ops" in proc.stderr


def test_launch_benchmark_reports_the_first_call_and_warm_calls_apart():
    result = bench_launch(nproc=2, repeat=3)
    warm = result["warm"]
    assert warm["min_s"] <= warm["median_s"] <= warm["max_s"] and len(warm["times_s"]) == 3
    assert result["first_s"] > 0 and "warm calls: median" in format_launch(result)


def test_the_projection_of_a_node_hides_what_the_planner_says_and_counts_the_rest():
    from course_lib.bench.fsdp import projected_steps
    from course_lib.collectives.cost_model import H100_NODE
    from course_lib.hybrid.costs import H100_NVSWITCH_NODE
    from course_lib.memory.estimate import OLMO

    node = H100_NVSWITCH_NODE
    # one model of the switch everywhere: a ring rank sends to its one peer at 450 GB/s
    assert node.nvlink_pair_gbps * 1e9 == pytest.approx(H100_NODE["bandwidth"])
    steps = projected_steps(OLMO["OLMo 1B"], node, global_batch=64)
    assert len({round(s["compute"], 12) for s in steps.values()}) == 1  # sharding adds no FLOPs
    assert all(0 <= s["dp_comm"] <= s["dp_comm_alone"] for s in steps.values())
    m = 64 // node.gpus_per_node  # microbatches of one sequence per replica
    # unhidden, ZeRO-3 gathers twice and reduce-scatters once per microbatch: 1.5 m
    # all-reduces' worth against DDP's one (latency, microseconds here, aside)
    ratio = steps["ZeRO-3"]["dp_comm_alone"] / steps["ZeRO-0"]["dp_comm_alone"]
    assert ratio == pytest.approx(1.5 * m, rel=0.02)
