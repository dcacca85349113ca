"""Experts inside the mesh: the MoE GPT with ep = dp trains like one process on the whole
batch, at world sizes 2 and 3 (capacity drops included)."""
import pytest

from conftest import ship_by_value
from course_lib import run
from course_lib.hybrid.experts import reference_moe_training, train_dp_ep
from course_lib.hybrid.strategies import max_difference
from course_lib.pipeline.runs import corpus_config

ship_by_value(__name__)

CFG = corpus_config(layers=2, dim=16, heads=2, seq_len=8)


@pytest.mark.parametrize("world, experts, top_k, factor", [(2, 4, 2, 1.0), (3, 3, 1, 0.75)])
def test_experts_over_the_data_parallel_ranks_train_as_one_process(world, experts, top_k, factor):
    kw = dict(n_experts=experts, top_k=top_k, steps=3, batch=6 * world,
              capacity_factor=factor)
    reference = reference_moe_training(CFG, **kw)
    outs = run(train_dp_ep, CFG, **kw, nproc=world, timeout=300)
    gaps = [abs(a - b) for a, b in zip(outs[0]["losses"], reference["losses"])]
    assert len(gaps) == 3 and max(gaps) < 1e-5, gaps
    assert all(o["losses"] == outs[0]["losses"] for o in outs)
    # AdamW hides a gradient's scale from the loss (an expert's gradient left dp times too
    # large moves the losses by under 1e-5); the weights show it: 5e-4 and more, against
    # 2e-5 at most when right
    assert max_difference(outs[0]["state"], reference["state"]) < 1e-4


def _moe_rows(cfg):
    from course_lib.hybrid.table import strategy_table

    return strategy_table(cfg, batch=4, steps=1, names=("moe_dp", "moe_dp_ep"), dp=2, inner=1,
                          n_experts=4, top_k=2)


@pytest.mark.slow  # two strategies measured in one job: `make test-slow`
def test_the_tables_moe_rows_hold_what_the_estimate_says_and_ep_moves_tokens_not_experts():
    from course_lib.hybrid.experts import MoEGPT, moe_params
    from course_lib.hybrid.table import model_state_estimate

    shared, experts = moe_params(CFG, 4)
    model = MoEGPT(CFG, 4)
    assert shared + experts == sum(p.numel() for p in model.parameters())
    assert experts == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    replicated, ep = run(_moe_rows, CFG, nproc=2, timeout=300)[0]
    for row, name in ((replicated, "moe_dp"), (ep, "moe_dp_ep")):
        assert row["state_mb"] == pytest.approx(
            model_state_estimate(name, CFG, 2, 1, n_experts=4) / 1e6, abs=1e-9), name
    # each rank holds half the experts, 16 bytes per parameter less for the other half
    assert replicated["state_mb"] - ep["state_mb"] == pytest.approx(16 * experts / 2 / 1e6)
    # replicated experts all-reduce every expert's gradient; ep none of them, and sends
    # the tokens point to point instead
    assert replicated["p2p_mb"] == 0 and ep["p2p_mb"] > 0
    assert replicated["collective_mb"] - ep["collective_mb"] == pytest.approx(
        4 * experts / 1e6, rel=1e-6)
