import numpy as np
import pytest

from course_lib.cost_model import fit_alpha_beta, p2p_time


def test_fit_recovers_alpha_and_bandwidth():
    sizes = np.logspace(2, 8, 13)
    alpha, bw = 50e-6, 2e9
    t = p2p_time(sizes, alpha, bw) * (1 + 0.01 * np.sin(np.arange(13)))  # 1% noise
    fit_alpha, fit_bw = fit_alpha_beta(sizes, t)
    assert fit_alpha == pytest.approx(alpha, rel=0.05)
    assert fit_bw == pytest.approx(bw, rel=0.05)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError):
        fit_alpha_beta([1], [1.0])
    with pytest.raises(ValueError):
        fit_alpha_beta([1, 2, 3], [3.0, 2.0, 1.0])
