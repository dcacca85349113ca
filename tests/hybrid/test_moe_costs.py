"""The MoE cost model (course_lib.hybrid.moe_costs): pure arithmetic, checked against the
dense model it extends, against the experts the course builds, and by hand."""
import dataclasses

import pytest

from course_lib.ep.moe import Expert
from course_lib.hybrid import plan
from course_lib.hybrid.costs import memory_per_gpu, step_time
from course_lib.hybrid.moe_costs import Experts, a2a_seconds, ep_groups, expert_params, moe_costs
from course_lib.memory.estimate import GB, OLMO

ONE_B, WORK, H100 = OLMO["OLMo 1B"], plan.Workload(zero=0), plan.H100_80GB


def test_an_expert_is_the_courses_expert_and_one_expert_is_the_dense_model():
    d = 24
    assert expert_params(dataclasses.replace(ONE_B, dim=d)) == sum(
        p.numel() for p in Expert(d, 4 * d).parameters())
    mesh = plan.Mesh(dp=8, tp=2, pp=2)
    one = moe_costs(ONE_B, mesh, WORK, H100, Experts(1, 1), ep=1)
    dense, t = memory_per_gpu(ONE_B, mesh, WORK), step_time(ONE_B, mesh, WORK, H100)
    assert one["memory"] == pytest.approx(dense["total"])
    assert one["total"] == pytest.approx(t["total"]) and one["a2a"] == 0
    assert 0 < one["expert_sync"] < t["dp_comm"]  # the MLP's share of the gradient traffic


def test_replicated_experts_cost_their_state_and_ep_divides_it():
    mesh = plan.Mesh(dp=64)
    dense = memory_per_gpu(ONE_B, mesh, WORK)["total"]
    mlps = ONE_B.layers * expert_params(ONE_B)
    rows = {ep: moe_costs(ONE_B, mesh, WORK, H100, Experts(64, 2), ep) for ep in (1, 2, 8, 64)}
    # ZeRO-0, mixed precision: 16 bytes per parameter, the 63 more experts of every layer
    assert rows[1]["memory"] - dense == pytest.approx(16 * 63 * mlps)
    assert rows[64]["memory"] == pytest.approx(dense)  # one expert per GPU: the dense size
    assert rows[1]["memory"] > rows[2]["memory"] > rows[8]["memory"] > rows[64]["memory"]
    assert not rows[1]["fits"] and rows[64]["fits"]
    # the replicated experts' gradients are all-reduced; at ep = dp nothing is
    assert rows[1]["expert_sync"] > rows[8]["expert_sync"] > 0 == rows[64]["expert_sync"]
    # top-2 runs two experts a token: compute grows by one MLP per layer per token
    dense_t = step_time(ONE_B, mesh, WORK, H100)["compute"]
    assert rows[8]["compute"] / dense_t == pytest.approx(
        1 + mlps / plan.params_per_gpu(ONE_B, plan.Mesh()))


def test_the_all_to_all_by_hand_and_its_links_inside_and_across_nodes():
    mesh = plan.Mesh(dp=16, tp=2)
    s, h, m, layers = ONE_B.seq_len, ONE_B.dim, WORK.microbatches(mesh), ONE_B.layers
    # ep groups: dp neighbours, one every tp = 2 GPUs: {0, 2}, {1, 3}, {4, 6}, ...
    assert ep_groups(mesh, 2)[:3] == [[0, 2], [1, 3], [4, 6]]
    # ep = 2, one 4-GPU board: the half of the 2 s k = 2 token copies (h / tp bf16 values
    # each) that leave go to the one peer over its pair link
    per_peer = 2 * (s * 2) * h / 2 / 2
    want = 4 * layers * m * (H100.nvlink_alpha_s + per_peer / (H100.nvlink_pair_gbps * 1e9))
    assert moe_costs(ONE_B, mesh, WORK, H100, Experts(8, 2), 2)["a2a"] == pytest.approx(want)
    # ep = 4: {0, 2, 4, 6} spans two nodes: one peer on NVLink, two on InfiniBand, at once
    quarter = 2 * (s * 2) * h / 2 / 4
    assert a2a_seconds(H100, mesh, 4, quarter) == pytest.approx(
        H100.ib_alpha_s + max(quarter / (H100.nvlink_pair_gbps * 1e9),
                              2 * quarter / (H100.ib_gbps * 1e9)))
    from course_lib.hybrid.costs import H100_NVSWITCH_NODE as switch

    # through a switch the three peers of a node share the GPU's bandwidth
    assert a2a_seconds(switch, mesh, 4, quarter) == pytest.approx(
        switch.nvlink_alpha_s + 3 * quarter / (switch.nvlink_pair_gbps * 1e9))
    # a group that straddles two nodes ({3, 4, 5} of 4-GPU nodes) pays InfiniBand
    straddle = plan.Mesh(dp=12)
    assert ep_groups(straddle, 3)[1] == [3, 4, 5]
    assert a2a_seconds(H100, straddle, 3, 1e6) == pytest.approx(
        H100.ib_alpha_s + max(1e6 / (H100.nvlink_pair_gbps * 1e9), 2e6 / (H100.ib_gbps * 1e9)))
    recompute = dataclasses.replace(WORK, checkpointing=True)
    assert moe_costs(ONE_B, mesh, recompute, H100, Experts(8, 2), 2)["a2a"] == pytest.approx(
        1.5 * want)


def test_bad_ep_and_top_k_are_refused_by_name():
    with pytest.raises(ValueError, match="ep=3 must divide dp=8"):
        moe_costs(ONE_B, plan.Mesh(dp=8), WORK, H100, Experts(8, 2), 3)
    with pytest.raises(ValueError, match="ep=16 must divide dp=16 and the 8 experts"):
        moe_costs(ONE_B, plan.Mesh(dp=16), WORK, H100, Experts(8, 2), 16)
    with pytest.raises(ValueError, match="top_k"):
        moe_costs(ONE_B, plan.Mesh(dp=8), WORK, H100, Experts(8, 9), 1)


def test_the_table_lists_every_ep_that_divides_and_prints_it(capsys):
    rows = plan.ep_table(ONE_B, plan.Mesh(dp=12), plan.Workload(global_batch=2040), H100,
                         Experts(8, 2))
    assert [r[0] for r in rows] == [1, 2, 4]
    assert "tokens/s" in capsys.readouterr().out and all(r[1] > 0 for r in rows)
    assert rows[0][1] * GB == pytest.approx(moe_costs(
        ONE_B, plan.Mesh(dp=12), plan.Workload(global_batch=2040), H100, Experts(8, 2), 1)["memory"])
