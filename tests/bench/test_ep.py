"""The expert-parallel benchmark and Lab 07's traced steps (tiny sizes): spans, loads,
bytes and outputs, never time."""
import json
import subprocess
import sys

import pytest

from conftest import ship_by_value
from course_lib import run
from course_lib.bench import ep as be

ship_by_value(__name__)

SHAPE = dict(tokens=96, dim=8, experts=4, top_k=2)
MINE = ("dispatch", "combine", "combine backward", "dispatch backward")


def test_loads_count_every_assignment_and_the_overloaded_expert_gets_the_most():
    loads = be.loads(nproc=2, overloaded=2, **SHAPE)
    for label in ("balanced", "overloaded"):
        per_expert = loads[label]["per_expert"]
        assert sum(per_expert) == 96 * 2
        assert loads[label]["per_rank"] == [sum(per_expert[:2]), sum(per_expert[2:])]
    balanced, over = loads["balanced"]["per_expert"], loads["overloaded"]["per_expert"]
    assert over[2] == max(over) and over.count(over[2]) == 1
    assert over[2] >= 0.9 * 96  # nearly every token has it among its two
    assert max(balanced) < 0.6 * 96
    assert loads["overloaded"]["kept"] == over  # its capacity drops nothing
    assert loads["overloaded"]["per_rank"][1] > loads["overloaded"]["per_rank"][0]


def test_loads_refuse_experts_that_do_not_split():
    with pytest.raises(ValueError, match="4 experts do not split over 3 ranks"):
        be.loads(nproc=3, **SHAPE)


@pytest.mark.parametrize("nproc,overloaded", [(2, None), (2, 3), (3, 3)])
def test_a_traced_step_shows_dispatch_each_expert_and_combine_on_every_rank(nproc, overloaded):
    shape = dict(SHAPE, experts=2 * nproc)  # two experts a rank
    traced = run(be.traced_step, overloaded=overloaded, nproc=nproc, **shape)
    loads = be.loads(nproc=nproc, overloaded=3, **shape)
    loads = loads["overloaded" if overloaded else "balanced"]
    expert_rows = {}
    for rank, got in enumerate(traced):
        a, b = got["experts"]
        assert (a, b) == (2 * rank, 2 * rank + 1)
        assert got["rows"] == loads["per_expert"][a:b + 1]
        spans = [s for s in traced.trace.select(rank=rank)
                 if s.name in MINE or s.name.startswith("expert ")]
        assert [s.name for s in spans] == [
            "dispatch", f"expert {a}", f"expert {b}", "combine", "combine backward",
            f"expert {b} backward", f"expert {a} backward", "dispatch backward"]
        assert all(s.cat == ("compute" if s.name.startswith("expert") else "comm")
                   for s in spans)
        for s in spans:
            if s.name.startswith("expert"):
                e = int(s.name.split()[1])
                assert s.args["rows"] == min(got["capacity"], loads["per_expert"][e])
                expert_rows[e] = s.args["rows"]
    assert sum(expert_rows.values()) == sum(loads["kept"])
    if overloaded is not None:
        assert expert_rows[3] == 96 and max(expert_rows, key=expert_rows.get) == 3


def sent_in_one_forward():
    import torch.distributed as dist

    from course_lib import comm
    from course_lib.ep import ExpertParallelMoE

    moe, x, _ = be.build(**SHAPE)
    layer = ExpertParallelMoE.from_dense(moe)
    peer = 1 - dist.get_rank()
    routed = [be._routed(moe, part) for part in x.tensor_split(2)]  # per source rank
    with comm.counting() as stats:
        layer(be._mine(x))
    return stats.sent_bytes, routed[dist.get_rank()][2 * peer:2 * peer + 2].sum().item(), \
        routed[peer][2 * (1 - peer):2 * (1 - peer) + 2].sum().item()


def test_the_dispatch_sends_rows_and_counts_per_expert_and_no_expert_ids():
    for sent, to_peer, from_peer in run(sent_in_one_forward, nproc=2):
        # rows out and results back (float32), and the counts of the peer's two experts,
        # one per choice (int64): the owner serves first choices first
        assert sent == 4 * SHAPE["dim"] * (to_peer + from_peer) + 8 * 2 * SHAPE["top_k"]


def test_measure_checks_ours_against_dense_and_splits_a_step():
    result = run(be.measure, steps=1, rounds=1, split_steps=1, nproc=2, **SHAPE)[0]
    assert result["max_diff"] < 1e-5
    assert set(result["step_s"]) == {"ours", "dense"} and all(
        v > 0 for v in result["step_s"].values())
    assert result["tokens_per_s"]["ours"] == pytest.approx(96 / result["step_s"]["ours"])
    assert result["ratio"] == pytest.approx(result["step_s"]["dense"] / result["step_s"]["ours"])
    assert len(result["split"]) == 2
    for part in result["split"]:
        assert 0 < part["all_to_all_s"] + part["experts_s"] <= part["step_s"]
        assert part["experts_s"] > 0
    table = be.format_table(result, 2)
    assert "ratio ours / dense (tokens/s)" in table and "rank 1: all-to-all" in table


@pytest.mark.slow
def test_the_ep_benchmark_runs_from_the_command_line(tmp_path):
    out = tmp_path / "ep.json"
    proc = subprocess.run([sys.executable, "-m", "course_lib.bench", "ep", "--nproc", "2",
                           "--tokens", "64", "--dim", "8", "--experts", "4", "--steps", "1",
                           "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["max_diff"] < 1e-5 and result["shape"]["nproc"] == 2
    assert "ratio ours / dense" in proc.stdout
