"""Exercise and prediction ids: what a check, a heading and the gradebook agree on."""
import pytest

from course_lib.grading import checks, ids


@pytest.mark.parametrize("written,id_", [
    ("Exercise 2.3", "Exercise 2.3"), ("exercise  2.3", "Exercise 2.3"), ("2.3", "Exercise 2.3"),
    ("prediction 1.1", "Prediction 1.1"), (" Prediction 4.2 ", "Prediction 4.2"),
    ("the bonus", "the bonus"),
])
def test_ids_are_written_one_way(written, id_):
    assert ids.normalize(written) == id_


def test_gradebook_columns_go_by_lab_exercises_first_then_predictions():
    columns = ["Prediction 1.2", "Exercise 10.1", "Exercise 1.2", "Prediction 1.1", "Exercise 1.1",
               "Exercise 2.1"]
    assert sorted(columns, key=ids.sort_key) == [
        "Exercise 1.1", "Exercise 1.2", "Prediction 1.1", "Prediction 1.2", "Exercise 2.1",
        "Exercise 10.1"]


def test_a_failed_prediction_is_recorded_under_its_own_id():
    with pytest.raises(checks.CheckFailed) as caught:
        raise checks.CheckFailed("Prediction 9.1: 12 bytes, the formula says 14")
    assert caught.value.exercise == "Prediction 9.1"
    assert checks.outcome("prediction 9.1") == "failed"


@pytest.mark.parametrize("heading,found", [
    ("### Prediction 3.2: model state under ZeRO-2",
     ("Prediction 3.2", "3.2", "model state under ZeRO-2")),
    ("## Exercise 1.5 - pipelined broadcast", ("Exercise 1.5", "1.5", "pipelined broadcast")),
    ("## Predictions and exercises", None),
])
def test_headings_open_either_kind(heading, found):
    match = ids.HEADING.search(heading)
    assert (match.groups() if match else None) == found
