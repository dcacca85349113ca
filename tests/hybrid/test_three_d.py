"""DP x TP x PP at once, 8 gloo ranks as (pp, dp, tp) = (2, 2, 2): the course GPT trains
to the single-process run's losses and parameters; every rank sits where the mesh puts
it; the strategy table's row measures the state it estimates."""
import pytest

from conftest import ship_by_value
from course_lib import run
from course_lib.hybrid import table
from course_lib.hybrid.strategies import max_difference, reference_training
from course_lib.pipeline.runs import corpus_config

ship_by_value(__name__)

CFG = corpus_config(layers=2, dim=32, heads=4, seq_len=16)
STEPS, BATCH = 3, 8


def three_d(cfg):
    from course_lib.hybrid.strategies import train_strategy

    trained = train_strategy("dp_tp_pp", cfg, steps=STEPS, batch=BATCH, dp=2, inner=4, tp=2,
                             microbatches=2)
    row = table.measure_strategy("dp_tp_pp", cfg, batch=BATCH, steps=1, dp=2, inner=4, tp=2)
    return trained, row


@pytest.mark.slow  # 8 ranks, three strategies: `make test-slow`
def test_three_dims_at_once_train_as_one_process():
    reference = reference_training(CFG, steps=STEPS, batch=BATCH)
    outs = run(three_d, CFG, nproc=8, timeout=300)
    trained, row = outs[0]
    gaps = [abs(a - b) for a, b in zip(trained["losses"], reference["losses"])]
    assert len(gaps) == STEPS and max(gaps) < 1e-5, gaps
    assert max_difference(trained["state"], reference["state"]) < 5e-4
    # (pp, dp, tp) of ranks 0..7: tp fastest, then dp, then pp
    assert [o[0]["coords"] for o in outs] == [(p, d, t) for p in (0, 1) for d in (0, 1)
                                             for t in (0, 1)]
    assert row["strategy"] == "DP x TP x PP" and row["p2p_mb"] > 0
    assert row["state_mb"] == pytest.approx(
        table.model_state_estimate("dp_tp_pp", CFG, 2, 4, 2) / 1e6, abs=1e-9)


def test_an_inner_that_tp_does_not_divide_is_refused():
    def build_it(cfg):
        from course_lib.hybrid.strategies import build

        build("dp_tp_pp", cfg, dp=1, inner=3, tp=2)

    with pytest.raises(Exception, match="inner = 3 ranks per replica is not a multiple of tp = 2"):
        run(build_it, CFG, nproc=3, timeout=120)
