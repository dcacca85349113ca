"""Graded predictions: the student's numbers against the formula, with the reason for a
known wrong one (pure logic: the student's function runs in this process)."""
import numpy as np
import pytest
import torch

from course_lib.ddp import traffic
from course_lib.grading import checks
from course_lib.grading.lab00 import predictions as lab00
from course_lib.grading.lab01 import predictions as lab01
from course_lib.grading.lab02 import predictions as lab02
from course_lib.grading.lab03_fsdp import predictions as lab03
from course_lib.grading.lab03_mixed import predictions as lab03_mixed
from course_lib.grading.lab04 import predictions as lab04
from course_lib.grading.lab05 import predictions as lab05
from course_lib.grading.lab06 import predictions as lab06
from course_lib.grading.lab07 import predictions as lab07
from course_lib.grading.lab08 import predictions as lab08
from course_lib.grading.predictions import grade_numbers, predicted_numbers


def test_numbers_come_back_as_floats_and_anything_else_as_a_reason():
    values = iter([3, 2.5, np.float32(1.5), torch.tensor(4.0), True, "7", torch.ones(2)])
    answers = predicted_numbers(lambda i: next(values), [(i,) for i in range(7)])
    assert [a.get("value") for a in answers[:4]] == [3.0, 2.5, 1.5, 4.0]
    assert all(type(a["value"]) is float for a in answers[:4])
    assert [a["message"] for a in answers[4:]] == [
        "returned bool, not a number", "returned str, not a number",
        "returned Tensor, not a number"]


def test_a_wrong_number_names_the_setting_and_the_known_mistake():
    cases = [(2,), (3,)]
    answers = predicted_numbers(lambda k: 2 * k, cases)
    with pytest.raises(checks.CheckFailed, match=r"Prediction 9\.2: for k = 2 you predicted 4; "
                                                 r"it is 1\.\nWhy: doubled"):
        grade_numbers("Prediction 9.2", answers, cases, lambda k: k - 1, lambda k: f"k = {k}",
                      [(lambda k: 2 * k, "doubled")])
    with pytest.raises(checks.CheckFailed, match="it is 1.\nHint: count"):
        grade_numbers("Prediction 9.2", answers, cases, lambda k: k - 1, lambda k: f"k = {k}",
                      hint="count")


def right_bytes(algorithm, n, k, rank):
    if k == 1:
        return 0
    if algorithm == "naive":
        return (k - 1) * n if rank == 0 else n
    return 2 * (k - 1) * n // k


def right_step_bytes(wrapper, p, b, o, k):
    if k == 1:
        return 0
    return (k - 1) / k * (b + o) + (k - 1) * p if wrapper == "dp" else 2 * (k - 1) / k * p


# each prediction's check, the solution's function, and the kept wrong formulas
PREDICTIONS = [
    ("0.1", lab00.check_half_size_prediction, lambda a, b: a * b, lab00.HALF_WRONG),
    ("0.2", lab00.check_compute_share_prediction, lambda mine, slowest: mine / slowest,
     lab00.SHARE_WRONG),
    ("1.1", lab01.check_bytes_prediction, right_bytes, lab01.BYTES_WRONG),
    ("1.2", lab01.check_ring_time_prediction,
     lambda n, k, a, b: 2 * (k - 1) * (a + n / (k * b)), lab01.TIME_WRONG),
    ("2.1", lab02.check_bytes_per_step_prediction, right_step_bytes, lab02.BYTES_WRONG),
    ("2.2", lab02.check_gradient_ratio_prediction, lambda m, d: 1 if d else m,
     lab02.RATIO_WRONG),
    ("3.1", lab03.check_traffic_prediction,
     lambda s, p, n: {"ddp": 2, "zero1_all_reduce": 3, "zero1_reduce_scatter": 2, "fsdp_full": 3,
                      "fsdp_grad_op": 2}[s] * (n - 1) / n * 4 * p, lab03.BYTES_WRONG),
    ("3.2", lab03_mixed.check_state_prediction,
     lambda r, p: {"fp32": 16, "autocast_bf16": 16, "bf16_master": 16, "pure_bf16": 8}[r] * p,
     lab03_mixed.STATE_WRONG),
    ("4.1", lab04.check_bubble_prediction, lambda p, m: (p - 1) / (m + p - 1),
     lab04.BUBBLE_WRONG),
    ("4.2", lab04.check_in_flight_prediction,
     lambda kind, p, m, s: m if kind == "gpipe" else min(m, p - s), lab04.IN_FLIGHT_WRONG),
    ("5.1", lab05.check_all_reduce_count_prediction, lambda direction, t: 2, lab05.COUNT_WRONG),
    ("5.2", lab05.check_all_reduce_size_prediction, lambda b, s, h, t: b * s * h,
     lab05.SIZE_WRONG),
    ("6.1", lab06.check_p2p_bytes_prediction,
     lambda s, p, b, dp, m, t, d: ((s > 0) + (s < p - 1)) * b // dp * t * d * 4,
     lab06.P2P_WRONG),
    ("6.2", lab06.check_state_bytes_prediction,
     lambda p, dp, tp, pp, z: p / (tp * pp) * (2 / (dp if z == 3 else 1)
                                               + 2 / (dp if z >= 2 else 1) + 12 / (dp if z else 1)),
     lab06.STATE_WRONG),
    ("7.2", lab07.check_traffic_prediction,
     lambda sp, b, s, h, n, k: 4 * {"cp": 2 * (n - 1) * b * s * h / n,
                                    "tp_sp": 2 * (n - 1) / n * b * s * h,
                                    "ep": 2 * k * (n - 1) / n * b * s / n * h}[sp],
     lab07.TRAFFIC_WRONG),
    ("7.1", lab07.check_activation_prediction,
     lambda b, s, h, heads, cp: 4 * (6 * b * s * h + b * heads * s) / cp, lab07.MEMORY_WRONG),
    ("8.1", lab08.check_bytes_prediction, lambda p, n: 12 * p / n, lab08.BYTES_WRONG),
    ("8.2", lab08.check_interval_prediction, lambda c, m: (2 * c * m) ** 0.5,
     lab08.INTERVAL_WRONG),
]


@pytest.mark.parametrize("number,check,right,_", PREDICTIONS, ids=[p[0] for p in PREDICTIONS])
def test_each_prediction_passes_as_the_solution_writes_it_and_its_stub_fails(capsys, number,
                                                                              check, right, _):
    check(right)
    assert f"✓ Prediction {number} passed" in capsys.readouterr().out

    def stub(*args):
        raise NotImplementedError(f"Prediction {number}: a stub")

    with pytest.raises(NotImplementedError, match="is not implemented yet"):
        check(stub)


@pytest.mark.parametrize("number,check,wrong,why",
                         [(n, check, *w) for n, check, _, wrongs in PREDICTIONS for w in wrongs],
                         ids=lambda x: str(x)[:24])
def test_each_kept_wrong_prediction_fails_with_its_reason(number, check, wrong, why):
    with pytest.raises(checks.CheckFailed) as failed:
        check(wrong)
    assert str(failed.value).startswith(f"Prediction {number}: ")
    assert f"Why: {why}" in str(failed.value)


def test_a_byte_count_that_ignores_the_rank_fails_on_a_rank_other_than_the_root():
    with pytest.raises(checks.CheckFailed, match="rank 3 of the naive"):
        lab01.check_bytes_prediction(lambda a, n, k, r: (k - 1) * n if a == "naive"
                                     else right_bytes(a, n, k, r))


def test_the_library_s_cost_model_handed_in_as_a_prediction_is_refused(monkeypatch):
    from course_lib.collectives import cost_model

    monkeypatch.setattr(checks, "_reference_guard", True)
    with pytest.raises(checks.CheckFailed, match="Prediction 1.2: .*ring_all_reduce_time"):
        lab01.check_ring_time_prediction(cost_model.ring_all_reduce_time)


def test_two_wrong_formulas_that_agree_on_one_setting_are_told_apart_by_the_others():
    """At stage 3 of p = 4, "min(m, p)" and "min(m, s + 1)" both say 4: the reason given
    is that of the formula the student's other answers follow."""
    with pytest.raises(checks.CheckFailed, match="the last stage alternates from the start"):
        lab04.check_in_flight_prediction(lambda k, p, m, s: m if k == "gpipe" else min(m, p))


def test_a_prediction_that_calls_the_library_s_traffic_formula_is_refused(monkeypatch):
    monkeypatch.setattr(checks, "_reference_guard", True)

    def predicted(wrapper, p, b, o, k):  # reaches the library's formula by a global name
        return traffic.dp_bytes_through_device0(p, b, o, k)["sent"]

    with pytest.raises(checks.CheckFailed, match="Prediction 2.1: .*dp_bytes_through_device0"):
        lab02.check_bytes_per_step_prediction(predicted)


def test_the_library_s_model_state_formula_in_a_prediction_is_refused(monkeypatch):
    from course_lib.memory.estimate import model_state_bytes

    monkeypatch.setattr(checks, "_reference_guard", True)

    def predicted(p, dp, tp, pp, z):  # the answer, by way of Lab 03's estimator
        return model_state_bytes(p / (tp * pp), dp, z)["total"]

    with pytest.raises(checks.CheckFailed, match="Prediction 6.2: .*model_state_bytes"):
        lab06.check_state_bytes_prediction(predicted)


def test_a_checkpoint_size_that_counts_the_step_on_rank_0_passes(capsys):
    """Adam's step count, 4 bytes (or 8) that rank 0 writes once, is within the tolerance
    of every setting: counting it is not a mistake."""
    lab08.check_bytes_prediction(lambda p, n: 12 * p / n + 8)
    assert "✓ Prediction 8.1 passed" in capsys.readouterr().out


def test_young_s_and_daly_s_intervals_both_pass_and_a_blend_of_them_does_not(capsys):
    """Both are first order (Daly counts the write in the cycle: sqrt(2CM) - C); the
    answers are graded against whichever the student wrote, on every setting."""
    import math

    lab08.check_interval_prediction(lambda c, m: math.sqrt(2 * c * m))
    lab08.check_interval_prediction(lambda c, m: math.sqrt(2 * c * m) - c)
    assert capsys.readouterr().out.count("✓ Prediction 8.2 passed") == 2
    with pytest.raises(checks.CheckFailed, match="Prediction 8.2: for C = 60 s"):
        lab08.check_interval_prediction(lambda c, m: math.sqrt(2 * c * m) - c / 2)
    # Daly on one setting, Young on the rest: graded as Young, it fails where it is Daly
    with pytest.raises(checks.CheckFailed, match="Prediction 8.2: for C = 60 s"):
        lab08.check_interval_prediction(
            lambda c, m: math.sqrt(2 * c * m) - (c if c == 60 else 0))


def test_the_library_s_interval_and_state_formulas_in_a_prediction_are_refused(monkeypatch):
    from course_lib.checkpoint.goodput import young_interval
    from course_lib.memory.estimate import model_state_bytes

    monkeypatch.setattr(checks, "_reference_guard", True)
    with pytest.raises(checks.CheckFailed, match="Prediction 8.2: .*young_interval"):
        lab08.check_interval_prediction(young_interval)
    from course_lib.checkpoint.goodput import daly_interval

    with pytest.raises(checks.CheckFailed, match="Prediction 8.2: .*daly_interval"):
        lab08.check_interval_prediction(daly_interval)

    def predicted(p, n):  # the answer, by way of Lab 03's estimator in fp32
        state = model_state_bytes(p, n, 3, mixed=False)
        return state["params"] + state["optimizer"]

    with pytest.raises(checks.CheckFailed, match="Prediction 8.1: .*model_state_bytes"):
        lab08.check_bytes_prediction(predicted)
