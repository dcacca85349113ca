"""Graded predictions: the student's numbers against the formula, with the reason for a
known wrong one (pure logic: the student's function runs in this process)."""
import numpy as np
import pytest
import torch

from course_lib.grading import checks
from course_lib.grading.lab01 import predictions as lab01
from course_lib.grading.lab04 import predictions as lab04
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


def right_time(n, k, alpha, bandwidth):
    return 2 * (k - 1) * (alpha + n / (k * bandwidth))


def stub(*args):
    raise NotImplementedError("Prediction 1.1: the bytes each rank sends")


def test_lab01_predictions_pass_as_written_in_the_solution(capsys):
    lab01.check_bytes_prediction(right_bytes)
    lab01.check_ring_time_prediction(right_time)
    out = capsys.readouterr().out
    assert "✓ Prediction 1.1 passed" in out and "✓ Prediction 1.2 passed" in out


def test_lab01_prediction_stubs_fail():
    for check in (lab01.check_bytes_prediction, lab01.check_ring_time_prediction):
        with pytest.raises(NotImplementedError, match="is not implemented yet"):
            check(stub)


@pytest.mark.parametrize("wrong,why", lab01.BYTES_WRONG, ids=lambda x: str(x)[:40])
def test_each_kept_wrong_byte_count_fails_with_its_reason(wrong, why):
    with pytest.raises(checks.CheckFailed) as failed:
        lab01.check_bytes_prediction(wrong)
    assert f"Why: {why}" in str(failed.value)


@pytest.mark.parametrize("wrong,why", lab01.TIME_WRONG, ids=lambda x: str(x)[:40])
def test_each_kept_wrong_time_model_fails_with_its_reason(wrong, why):
    with pytest.raises(checks.CheckFailed) as failed:
        lab01.check_ring_time_prediction(wrong)
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


# ---- Lab 04 --------------------------------------------------------------------------------
def test_lab04_predictions_pass_as_written_in_the_solution(capsys):
    lab04.check_bubble_prediction(lambda p, m: (p - 1) / (m + p - 1))
    lab04.check_in_flight_prediction(lambda kind, p, m, s: m if kind == "gpipe"
                                     else min(m, p - s))
    out = capsys.readouterr().out
    assert "✓ Prediction 4.1 passed" in out and "✓ Prediction 4.2 passed" in out


@pytest.mark.parametrize("check,wrong,why",
                         [(lab04.check_bubble_prediction, *w) for w in lab04.BUBBLE_WRONG]
                         + [(lab04.check_in_flight_prediction, *w) for w in lab04.IN_FLIGHT_WRONG],
                         ids=lambda x: str(x)[:30])
def test_each_kept_wrong_lab04_prediction_fails_with_its_reason(check, wrong, why):
    with pytest.raises(checks.CheckFailed) as failed:
        check(wrong)
    assert f"Why: {why}" in str(failed.value)


def test_two_wrong_formulas_that_agree_on_one_setting_are_told_apart_by_the_others():
    """At stage 3 of p = 4, "min(m, p)" and "min(m, s + 1)" both say 4: the reason given
    is that of the formula the student's other answers follow."""
    with pytest.raises(checks.CheckFailed, match="the last stage alternates from the start"):
        lab04.check_in_flight_prediction(lambda k, p, m, s: m if k == "gpipe" else min(m, p))
