"""DP x CP x TP x PP at once, 16 gloo ranks as (pp, dp, cp, tp) = (2, 2, 2, 2): the course
GPT trains to the single-process run's losses and parameters; the 4-D layout's arithmetic
without processes."""
import pytest

from conftest import ship_by_value
from course_lib import run
from course_lib.hybrid import table
from course_lib.hybrid.four_d import FourDims
from course_lib.hybrid.strategies import max_difference, reference_training
from course_lib.pipeline.runs import corpus_config

ship_by_value(__name__)

CFG = corpus_config(layers=2, dim=32, heads=4, seq_len=16)
STEPS, BATCH = 3, 8


def test_the_layout_puts_tp_fastest_then_cp_dp_pp():
    dims = FourDims(dp=2, cp=2, tp=2, pp=2)
    assert [tuple(dims.coords_of(r)) for r in (0, 1, 2, 5, 15)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 1), (1, 1, 1, 1)]
    assert all(dims.rank_of(dims.coords_of(r)) == r for r in range(16))
    assert dims.group_ranks(("tp",), 5) == [4, 5]
    assert dims.group_ranks(("cp",), 5) == [5, 7]
    assert dims.group_ranks(("pp",), 5) == [5, 13]
    # the ranks holding the same weights: same pp and tp, every (dp, cp)
    assert dims.group_ranks(("dp", "cp"), 5) == [1, 3, 5, 7]
    # an odd mesh: 3 x 1 x 3 x 1
    odd = FourDims(dp=3, cp=3)
    assert odd.group_ranks(("cp",), 4) == [3, 4, 5] and odd.group_ranks(("dp",), 4) == [1, 4, 7]
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        FourDims(cp=0)


def four_d(cfg):
    from course_lib.hybrid.strategies import train_strategy
    from course_lib.hybrid.table import measure_strategy

    trained = train_strategy("dp_cp_tp_pp", cfg, steps=STEPS, batch=BATCH, dp=2, inner=8, tp=2,
                             cp=2, microbatches=2)
    row = measure_strategy("dp_cp_tp_pp", cfg, batch=BATCH, steps=1, dp=2, inner=8, tp=2, cp=2)
    return trained, row


@pytest.mark.slow
def test_four_dims_at_once_train_as_one_process():
    reference = reference_training(CFG, steps=STEPS, batch=BATCH)
    outs = run(four_d, CFG, nproc=16, timeout=600)
    trained, row = outs[0]
    gaps = [abs(a - b) for a, b in zip(trained["losses"], reference["losses"])]
    assert len(gaps) == STEPS and max(gaps) < 1e-5, gaps
    assert all(o[0]["losses"] == trained["losses"] for o in outs)  # every rank says the same
    assert max_difference(trained["state"], reference["state"]) < 5e-4
    assert [o[0]["coords"] for o in outs] == [(p, d, c, t) for p in (0, 1) for d in (0, 1)
                                              for c in (0, 1) for t in (0, 1)]
    # the table's row: the state it estimates is the state measured (cp holds no weights
    # of its own: 2 stages of blocks split 2 ways, as DP x TP x PP on 8 ranks)
    assert row["strategy"] == "DP x CP x TP x PP" and row["p2p_mb"] > 0
    assert row["state_mb"] == pytest.approx(
        table.model_state_estimate("dp_cp_tp_pp", CFG, 2, 8, 2, 2) / 1e6, abs=1e-9)
    assert table.params_per_rank("dp_cp_tp_pp", CFG, 2, 8, 2, 2) == \
        table.params_per_rank("dp_tp_pp", CFG, 2, 4, 2)


def refused(cfg, **kw):
    from course_lib.hybrid.strategies import build

    build("dp_cp_tp_pp", cfg, **kw)


def test_an_inner_or_a_sequence_that_does_not_cut_is_refused():
    # refused before a process group is touched: no job needed to see it
    with pytest.raises(ValueError, match=r"inner = 3 ranks per replica is not a multiple of "
                                         r"cp x tp = 2"):
        refused(CFG, dp=1, inner=3, tp=1, cp=2)
    with pytest.raises(ValueError, match="seq_len = 16 does not cut into cp = 3 equal chunks"):
        refused(CFG, dp=1, inner=3, tp=1, cp=3)
