"""The bytes a rank sends in one layer's forward pass (Prediction 7.2's formulas) against
the course's counters on real gloo ranks, for CP, TP with sequence parallelism and EP."""
import pytest

from course_lib import run
from course_lib.cp.traffic import SPLITS, layer_bytes_sent, measured_bytes_sent


@pytest.mark.parametrize("n", [2, 3])
def test_each_split_sends_what_the_formula_says(n):
    for split in SPLITS:  # 2 x 36 tokens: 36 / n per rank, a multiple of the E = 2n experts
        got = run(measured_bytes_sent, split, 2, 36, 12, heads=6, top_k=2, nproc=n,
                  timeout=120)
        want = layer_bytes_sent(split, 2, 36, 12, n, top_k=2)
        for rank, (sent, counts) in enumerate(got):
            assert sent == want, (split, n, rank, sent, want)
            # EP's counts: one int64 per (expert, choice) of each peer, k = 2, E/n = 2
            assert counts == ((n - 1) * 2 * 2 * 8 if split == "ep" else 0)


def test_the_formulas_on_the_lecture_setting():
    # one 4096-token sequence of width 1024 on 4 ranks: CP and TP+SP move the same 24 MiB
    assert layer_bytes_sent("cp", 1, 4096, 1024, 4) == 2 * 3 * 1024 * 1024 * 4
    assert layer_bytes_sent("tp_sp", 1, 4096, 1024, 4) == layer_bytes_sent("cp", 1, 4096, 1024, 4)
    assert layer_bytes_sent("ep", 1, 4096, 1024, 4, top_k=2) == 2 * 2 * 3 / 4 * 1024 * 1024 * 4
    with pytest.raises(ValueError, match="split must be one of"):
        layer_bytes_sent("dp", 1, 2, 3, 4)
