"""The MoE cost model (course_lib.hybrid.moe_costs): pure arithmetic, checked against the
dense model it extends, against the experts the course builds, and by hand."""
import dataclasses

import pytest

from course_lib.ep.moe import Expert
from course_lib.hybrid import plan
from course_lib.hybrid.costs import memory_per_gpu, step_time
from course_lib.hybrid.moe_costs import Experts, ep_link, expert_params, moe_costs
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
    assert one["total"] == pytest.approx(t["total"]) and one["a2a"] == one["expert_sync"] == 0


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


def test_the_all_to_all_by_hand_and_its_link_leaving_the_node():
    mesh = plan.Mesh(dp=16, tp=2)
    s, h, m, layers = ONE_B.seq_len, ONE_B.dim, WORK.microbatches(mesh), ONE_B.layers
    # ep = 2: 4 GPUs, one 4-GPU board; the token copies' half that leaves, over one pair link
    sent = 2 * (1 * s * 2) * h / 2 * (1 / 2)
    want = 4 * layers * m * (H100.nvlink_alpha_s + sent / (H100.nvlink_pair_gbps * 1e9))
    assert moe_costs(ONE_B, mesh, WORK, H100, Experts(8, 2), 2)["a2a"] == pytest.approx(want)
    assert ep_link(H100, mesh, 2)[1] == H100.nvlink_pair_gbps * 1e9
    assert ep_link(H100, mesh, 4) == (H100.ib_alpha_s, H100.ib_gbps * 1e9)  # 8 GPUs: 2 nodes
    from course_lib.hybrid.costs import H100_NVSWITCH_NODE as switch

    assert ep_link(switch, mesh, 4)[1] == switch.nvlink_pair_gbps * 1e9
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
