"""What the judge ships by value while a lab is graded (course_lib/grading/shipping.py):
every harness reaches the hidden answers it is built on in a way that can travel, every
shipped piece travels, and each piece a lab hands one item is another item's answer of
that same lab (or it would not need handing). No processes: the pickles are read back
here."""
import pickle
import sys
import types
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import apart, hiding, shipping
from course_lib.grading.labgen import exercises_in
from course_lib.grading.registry import REFERENCES

ROOT = Path(__file__).resolve().parents[2]
LABS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


def _exercises(path):
    return tuple(ex for ex, _ in exercises_in(nbformat.read(path, 4)))


def _grading_functions():
    import course_lib.grading.gradebook  # noqa: F401 - every lab's checks, as the judge has them

    for lab in LABS:
        __import__(f"course_lib.grading.lab{lab.name[:2]}")
    return [v for name, module in list(sys.modules.items())
            if name.startswith("course_lib.grading") and module is not None
            for v in vars(module).values()
            if isinstance(v, types.FunctionType) and v.__module__ == name]


def _reached(exercises):
    """The shipped pieces the grader's code reaches (the library's benchmarks and demos
    reach hidden answers too, but no check runs them)."""
    shipped = shipping.shipped(exercises)
    todo, seen = list(_grading_functions()), {}
    while todo:
        obj = todo.pop()
        for value in shipping._reaches(obj):
            if id(value) in shipped and id(value) not in seen:
                seen[id(value)] = value
                todo.append(value)
    return list(seen.values())


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.name[:2])
def test_what_a_harness_is_built_on_travels_by_value(lab):
    """No harness, and no shipped piece it reaches, imports a hidden answer in its body or
    reaches it as a module's attribute: both would find the sandbox's stand-in."""
    exercises = _exercises(lab)
    reached = [v for v in _reached(exercises) if isinstance(v, types.FunctionType)]
    assert shipping.unshippable(exercises, _grading_functions() + reached) == []


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.name[:2])
def test_every_shipped_piece_is_rebuilt_from_its_pickle(lab):
    exercises = _exercises(lab)
    shipped = shipping.shipped(exercises)
    hidden = [f"{m}.{n}" for m, names in hiding.items_of(exercises).items() for n in names
              if m.startswith("course_lib.")]
    assert hidden and all(any(f"{v.__module__}.{v.__qualname__}" == h for v in shipped.values())
                          for h in hidden), hidden
    # rebuilding a class here sets the rebuilt methods on the library's own class (and on
    # every class it carries): they are put back for the tests after this one
    kept = {cls: dict(vars(cls)) for cls in shipped.values() if isinstance(cls, type)}
    try:
        for piece in _reached(exercises):
            rebuilt = pickle.loads(shipping.dumps(piece, exercises))
            # a class comes back as itself in the process that pickled it (cloudpickle
            # tracks the classes it sent); a function is a new one, made from its code
            assert rebuilt.__qualname__ == piece.__qualname__
            assert isinstance(piece, type) or rebuilt is not piece
    finally:
        for cls, names in kept.items():
            for name, value in names.items():
                if name not in ("__dict__", "__weakref__") and vars(cls).get(name) is not value:
                    setattr(cls, name, value)


def test_a_piece_handed_to_an_item_is_another_items_answer_in_the_same_lab():
    labs = {ex: lab for lab in LABS for ex in _exercises(lab)}
    for item, entries in hiding.GIVEN.items():
        assert item in labs, item
        for entry in entries:
            owners = [ex for ex, refs in REFERENCES.items() if entry in refs and ex != item]
            assert any(labs.get(owner) == labs[item] for owner in owners), (item, entry)


def test_an_item_handed_a_piece_runs_it_on_ranks_that_end_with_the_request():
    from course_lib.grading.requests import call_each, here, on_ranks

    request, unwrap = apart.given("Exercise 6.3", here(call_each, len, [(("ab",), {})]))
    assert (request.kind, request.nproc, unwrap) == ("ranks", 1, True)
    assert request.harness.func is apart._with_given
    assert set(request.harness.args[0]) == set(hiding.GIVEN["Exercise 6.3"])
    ranks = on_ranks(call_each, len, [], nproc=3)
    assert apart.given("Exercise 6.4", ranks)[0].nproc == 3
    assert apart.given("Exercise 6.2", ranks) == (ranks, False)  # handed nothing


def test_an_answer_to_an_item_not_yet_decided_keeps_its_request_off_the_students_process():
    from course_lib.grading.lab02 import jobs
    from course_lib.grading.requests import Student, call_each, here, on_ranks

    items = _exercises(ROOT / "solutions" / "02_ddp.ipynb")
    ended = []
    account = apart.Account(items, lambda: ended.append(True))
    # 2.4's request trains the library's DDP: it carries answers to 2.2, 2.3 and 2.6
    training = on_ranks(jobs.accumulate, Student("train_step"), 2, nproc=2)
    assert {"Exercise 2.2", "Exercise 2.3", "Exercise 2.6"} <= \
        shipping.answers_carried(training, items)
    for done in ("Exercise 2.1", "Exercise 2.2", "Exercise 2.3"):
        account.decide(done)
    assert account.route("Exercise 2.4", training) == (training, False)
    assert account.held == {"Exercise 2.6"}  # 2.2 and 2.3 are decided: nothing to keep
    # a request in the student's process that would carry it goes to one rank instead
    moved, unwrap = account.route("Exercise 2.4", here(jobs.accumulate, Student("f"), 2))
    assert (moved.kind, moved.nproc, unwrap) == ("ranks", 1, True) and ended == []
    plain = here(call_each, len, [])
    assert account.route("Exercise 2.4", plain) == (plain, False)  # carries nothing
    account.decide("Exercise 2.4")  # the student's cells run next: the ranks end
    assert ended == [True] and account.held == set()
    account.decide("Exercise 2.5")
    assert len(ended) == 1  # nothing was held


def test_a_class_answer_sent_as_a_method_only_is_counted():
    from course_lib.ddp.buckets import Bucket
    from course_lib.grading.requests import call_each, here

    items = _exercises(ROOT / "solutions" / "02_ddp.ipynb")
    request = here(call_each, Bucket.mark_ready, [])
    assert "Exercise 2.6" in shipping.answers_carried(request, items)
