"""The capstone's strategies under real torchrun (gloo): DP, DP x TP, DP x PP and DP x FSDP
train the course GPT to the single-process run's losses and parameters, on a 2x2 mesh and
on 3 ranks; the strategy table's measured model state equals the estimate; bad input is
refused with a message."""
import pytest

from conftest import ship_by_value
from course_lib import run
from course_lib.hybrid import strategies, table
from course_lib.hybrid.strategies import STRATEGIES, max_difference, reference_training
from course_lib.pipeline.runs import corpus_config

ship_by_value(__name__)

CFG = corpus_config(layers=2, dim=32, heads=4, seq_len=16)
STEPS, BATCH = 3, 8
LOSS_TOL = 1e-5
# AdamW divides by the root of the second moment: an entry with a near-zero gradient
# moves by ~lr whatever rounding did to that gradient (see the lab's text)
PARAM_TOL = 5e-4


def every_strategy(cfg, dp, inner, batch, names):
    from course_lib.hybrid.strategies import train_strategy
    from course_lib.hybrid.table import strategy_table

    trained = {name: train_strategy(name, cfg, steps=STEPS, batch=batch, dp=dp, inner=inner)
               for name in names}
    rows = strategy_table(cfg, batch=batch, steps=1, names=names, dp=dp, inner=inner)
    return trained, rows


def _compare(trained, reference):
    for name, out in trained.items():
        gaps = [abs(a - b) for a, b in zip(out["losses"], reference["losses"])]
        assert len(out["losses"]) == STEPS and max(gaps) < LOSS_TOL, (name, gaps)
        assert max_difference(out["state"], reference["state"]) < PARAM_TOL, name


def test_every_strategy_on_a_2x2_mesh_trains_as_one_process_and_the_state_is_as_estimated():
    reference = reference_training(CFG, steps=STEPS, batch=BATCH)
    outs = run(every_strategy, CFG, 2, 2, BATCH, list(STRATEGIES), nproc=4, timeout=300)
    trained, rows = outs[0]
    _compare(trained, reference)
    assert [o[0]["dp_tp"]["coords"] for o in outs] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert [o[0]["dp_pp"]["coords"] for o in outs] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert all(o[0]["dp"]["state"] is None for o in outs[1:])  # the state comes back once
    for name, row in zip(STRATEGIES, rows):
        assert row["strategy"] == STRATEGIES[name]
        assert row["state_mb"] == pytest.approx(table.model_state_estimate(name, CFG) / 1e6,
                                                abs=1e-9), name
        assert row["tokens_per_s"] > 0
        # a step allocates at least the gradients of the rank that holds most
        assert row["step_peak_mb"] >= 4 * table.params_per_rank(name, CFG) / 1e6, name
    by_name = dict(zip(STRATEGIES, rows))
    # what each moves: PP alone sends point to point; FSDP gathers, so moves the most
    assert by_name["dp_pp"]["p2p_mb"] > 0
    assert all(by_name[n]["p2p_mb"] == 0 for n in ("dp", "dp_tp", "dp_fsdp"))
    assert by_name["dp_fsdp"]["collective_mb"] > by_name["dp"]["collective_mb"]
    # sharding cuts the model state below a whole replica's
    assert all(by_name[n]["state_mb"] < by_name["dp"]["state_mb"]
               for n in ("dp_tp", "dp_pp", "dp_fsdp"))


ODD = corpus_config(layers=2, dim=24, heads=6, seq_len=8)  # splits 3 ways


def test_three_ranks_one_replica_cut_three_ways():
    reference = reference_training(ODD, steps=STEPS, batch=6)
    names = ["dp_tp", "dp_pp", "dp_fsdp"]
    trained, rows = run(every_strategy, ODD, 1, 3, 6, names, nproc=3, timeout=300)[0]
    _compare(trained, reference)
    for name, row in zip(names, rows):
        assert row["state_mb"] == pytest.approx(
            table.model_state_estimate(name, ODD, 1, 3) / 1e6, abs=1e-9), name


def uneven_batch():
    from course_lib.hybrid.strategies import train_strategy

    return train_strategy("dp_fsdp", CFG, steps=1, batch=6, dp=2, inner=2)


def test_a_batch_that_does_not_split_over_the_replicas_is_refused_by_name():
    from course_lib.runtime.launcher import LaunchError

    with pytest.raises(LaunchError, match="6 rows does not split evenly over 4"):
        run(uneven_batch, nproc=4, timeout=120)


def test_unknown_strategy_and_estimates_by_hand():
    with pytest.raises(ValueError, match="unknown strategy"):
        strategies.build("zero", CFG)
    with pytest.raises(ValueError, match="unknown strategy"):
        table.params_per_rank("zero", CFG)
    d, v, t = CFG.dim, CFG.vocab, CFG.seq_len
    whole = d * (v + t) + 2 * (12 * d * d + 10 * d) + 2 * d + v * (d + 1)
    assert table.params_per_rank("dp", CFG) == whole
    assert table.params_per_rank("dp_tp", CFG, 2, 2) == whole - 2 * (12 * d * d + 4 * d) // 2
    # FSDP over 5: each of the 3 units padded up to a multiple of 5
    units = [d * (v + t) + 2 * d + v * (d + 1)] + [12 * d * d + 10 * d] * 2
    assert table.params_per_rank("dp_fsdp", CFG, 1, 5) == sum(-(-u // 5) for u in units)
    # (the TP layers' dense_state(), their slices put back together, is what makes the
    # DP x TP state above equal the reference's, at t = 2 and 3)
