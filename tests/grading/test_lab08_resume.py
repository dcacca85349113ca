"""Exercise 8.5's check: the solution passes (also as the gradebook's judge decides), the
stub and each plausible wrong answer fail with its own reason."""
import pytest
import torch
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib.checkpoint import ShardedTensor, state_of
from course_lib.grading import checks
from course_lib.grading.lab08.resume import check_exact_resume

ship_by_value(__name__)


def training_state(model, optimizer, cursor, step, group):
    state = state_of(model, optimizer)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.get_rng_state()
    state["rng"] = ShardedTensor(generator.view(1, -1).clone(), (world, generator.numel()),
                                 (rank, 0))
    state.update(cursor.position())
    state["step"] = step
    return state


def restore_training_state(state, cursor):
    torch.set_rng_state(state["rng"].local[0].clone())
    cursor.seek(state)
    return state["step"]


def model_only(model, optimizer, cursor, step, group):
    state = training_state(model, optimizer, cursor, step, group)
    return {k: v for k, v in state.items() if not k.startswith("optim.")}


def one_generator_for_all(model, optimizer, cursor, step, group):
    state = training_state(model, optimizer, cursor, step, group)
    state["rng"] = torch.get_rng_state()  # a plain tensor: saved once, by rank 0
    return state


def restore_replicated(state, cursor):
    torch.set_rng_state(state["rng"].clone())
    cursor.seek(state)
    return state["step"]


def restore_without_generator(state, cursor):
    cursor.seek(state)
    return state["step"]


def restore_without_data(state, cursor):
    torch.set_rng_state(state["rng"].local[0].clone())
    return state["step"]


def restore_from_zero(state, cursor):
    restore_training_state(state, cursor)
    return 0


def restore_without_return(state, cursor):
    restore_training_state(state, cursor)


# (a right answer passes as judged: test_solutions_judged.py grades Lab 08's solution, and
# make test runs this check on it in nbval)


@pytest.mark.slow  # a 3-rank job each: CI runs them after make test
@pytest.mark.parametrize("capture, restore, reason", [
    (model_only, restore_training_state, "AdamW's state was not back"),
    (one_generator_for_all, restore_replicated, "Rank 0's generator came back but not the "
                                                "other ranks'"),
    (training_state, restore_without_generator, "generator was not back"),
    (training_state, restore_without_data, "data cursor was not where it was"),
    (training_state, restore_from_zero, "returned 0 on rank 0"),
    (training_state, restore_without_return, "returned None on rank 0"),
])
def test_wrong_answers_fail_with_their_reason(capture, restore, reason):
    with pytest.raises(checks.CheckFailed, match="Exercise 8.5") as info:
        check_exact_resume(capture, restore)
    assert reason in str(info.value)


def test_the_stub_says_not_implemented():
    def stub(*args):
        raise NotImplementedError

    with pytest.raises(NotImplementedError, match="Exercise 8.5 is not implemented"):
        check_exact_resume(stub, stub)


def test_the_library_is_refused(sandbox):
    from course_lib.checkpoint.resume import restore_training_state as library_restore
    from course_lib.checkpoint.resume import training_state as library_capture

    with pytest.raises(checks.CheckFailed, match="course_lib.s own implementation"):
        judged(sandbox, check_exact_resume, library_capture, library_restore)


KEPT = {}


def keeps_it_in_memory(model, optimizer, cursor, step, group):
    """Saves the model, the optimizer and the step; keeps the generator and the data
    position in this process's memory, which a restart does not keep."""
    KEPT.update(rng=torch.get_rng_state(), data=cursor.position())
    return {**state_of(model, optimizer), "step": step}


def restores_from_memory(state, cursor):
    if KEPT:
        torch.set_rng_state(KEPT["rng"])
        cursor.seek(KEPT["data"])
    return state["step"]


@pytest.mark.slow
def test_state_kept_in_memory_does_not_survive_the_restart():
    with pytest.raises(checks.CheckFailed, match="Exercise 8.5"):
        check_exact_resume(keeps_it_in_memory, restores_from_memory)
