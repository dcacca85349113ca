"""Checks of Lab 08's exercises: the geometry under a sharded checkpoint.

8.1 (a flat range of a vector or a matrix as boxes) calls the student's function in the
student's process and judges each answer here: genuine, non-empty boxes inside the
tensor, at most 3 (1 for a vector), whose elements, box by box in row-major order, are
exactly start..start + length - 1 in order (so any equivalent decomposition passes).
8.2 (the overlap of two boxes, and the byte runs a load reads): :mod:`.runs`.
8.3 (an atomic sharded save: data, then the index, then the marker): :mod:`.atomic`.
8.4 (a resharding load, against DCP's on the same state): :mod:`.loading`.
8.5 (an exact resume: what to save besides the model, what to put back): :mod:`.resume`.
8.6 (an asynchronous save: the copy, the gather and the thread): :mod:`.background`.
8.7 (the newest step every pipeline stage committed, :mod:`.stages`, and the plan a
restart follows before its first save, :mod:`.restart`).
Predictions 8.1 and 8.2: :mod:`.predictions`.
"""
from __future__ import annotations

from course_lib.grading import checks
from course_lib.grading.lab08 import references
from course_lib.grading.lab08.atomic import check_atomic_save
from course_lib.grading.lab08.background import check_async_save
from course_lib.grading.lab08.predictions import (check_bytes_prediction,
                                                  check_interval_prediction)
from course_lib.grading.lab08.loading import check_resharding_load
from course_lib.grading.lab08.references import as_box, elements, spans
from course_lib.grading.lab08.restart import check_restart
from course_lib.grading.lab08.resume import check_exact_resume
from course_lib.grading.lab08.runs import check_overlap_and_runs
from course_lib.grading.lab08.stages import check_latest_complete
from course_lib.grading.requests import call_each, here

EX_FLAT = "Exercise 8.1"

__all__ = ["check_flat_range_boxes", "check_overlap_and_runs", "check_resharding_load",
           "check_atomic_save", "check_async_save", "check_exact_resume", "check_latest_complete", "check_restart",
           "check_bytes_prediction", "check_interval_prediction"]


# ---- 8.1: a flat range as boxes --------------------------------------------------------------
@checks.check(EX_FLAT, hidden=lambda rng: {"cases": references.drawn_flat_cases(rng)})
def check_flat_range_boxes(boxes_of_flat_range, cases=tuple(references.FLAT_CASES)):
    ex = EX_FLAT
    answers = yield here(call_each, boxes_of_flat_range,
                         [((shape, start, length), {}) for _, shape, start, length in cases])
    for (label, shape, start, length), answer in zip(cases, answers):
        call = f"boxes_of_flat_range({shape}, start={start}, length={length}) ({label})"
        got = checks.answer_value(ex, call, answer)
        why = _flat_mistake(got, shape, start, length)
        if why:
            right = references.flat_boxes(shape, start, length)
            raise checks.CheckFailed(f"{ex}: {call} returned {got!r}; one right answer is "
                                     f"{right}.\nWhy: {why}")
    return (f"{len(cases)} ranges of vectors and matrices: inside a row, whole rows, across "
            f"rows, empty, the whole tensor, 1-row and 1-column matrices")


def _flat_mistake(got, shape, start, length):
    """What is wrong with ``got`` as the boxes of [start, start + length), or None."""
    if not isinstance(got, (list, tuple)):
        return (f"return a list of boxes, each (offsets, sizes), not a "
                f"{type(got).__name__}" + (" (a range of length 0 is no boxes: [])"
                                            if got is None else ""))
    boxes = []
    for i, value in enumerate(got):
        box = as_box(value, len(shape))
        if box is None:
            return (f"box {i}, {value!r}, is not (offsets, sizes) with {len(shape)} whole "
                    f"numbers each (a tensor of shape {shape} has {len(shape)} dimensions)")
        offsets, sizes = box
        if any(z <= 0 for z in sizes):
            return (f"box {i} has sizes {sizes}: a box holds at least one element in every "
                    f"dimension; leave empty ones out (a range of length 0 is no boxes: [])")
        if any(o < 0 or o + z > g for o, z, g in zip(offsets, sizes, shape)):
            return (f"box {i} at offsets {offsets} with sizes {sizes} does not fit in shape "
                    f"{shape}: 0 <= offsets and offsets + sizes <= shape in every dimension")
        boxes.append(box)
    covered = [e for box in boxes for e in elements(box, shape)]
    why = _elements_mistake(covered, boxes, shape, start, start + length)
    if why:
        return why
    if len(boxes) > references.most_boxes(shape):
        if len(shape) == 1:
            return f"a range of a vector is one box: (({start},), ({length},))"
        return (f"{len(boxes)} boxes where 3 at most are needed: the whole rows in the middle "
                f"are one box, ((first row, 0), (number of rows, {shape[1]})), between a "
                f"partial first row and a partial last row")
    return None


def _at(shape, e):
    return f"element {e}" if len(shape) == 1 else f"element {e} (row {e // shape[1]}, " \
                                                  f"column {e % shape[1]})"


def _elements_mistake(covered, boxes, shape, start, end):
    want = list(range(start, end))
    if covered == want:
        return None
    twice = sorted({e for e in covered if covered.count(e) > 1})
    if twice:
        return (f"your boxes cover elements {spans(twice)} more than once: the boxes of a "
                f"range must not overlap")
    extra, missing = sorted(set(covered) - set(want)), sorted(set(want) - set(covered))
    say = f"the range is elements {start}..{end - 1}" if end > start else "the range is empty"
    if not extra and not missing:
        starts = ", ".join(str(elements(box, shape)[0]) for box in boxes)
        return (f"the right elements in the wrong order: your boxes begin at elements "
                f"{starts}. List the boxes in the order of the flattened range (box by box "
                f"they read {start}, {start + 1}, ..., {end - 1}): the partial first row, "
                f"then the whole rows, then the partial last row")
    if missing == [end - 1] and not extra:
        return (f"the last element, {end - 1}, is missing: {say}; [start, start + length) "
                f"ends at start + length - 1 = {end - 1}")
    if extra == [end] and not missing:
        return (f"one element too many, {_at(shape, end)}: {say}; [start, start + length) "
                f"stops before start + length = {end}")
    if len(shape) == 2 and missing and covered[0] != start and start % shape[1] \
            and boxes[0][0][1] == 0 and covered[0] // shape[1] == start // shape[1]:
        c = start % shape[1]
        return (f"your first box begins at column 0 of row {start // shape[1]}, but the "
                f"range begins at {_at(shape, start)}: the first box starts at column "
                f"start % {shape[1]} = {c}")
    if extra and not missing:
        why = (f"your boxes cover elements {spans(extra)}, which are outside the range "
               f"({say})")
        if len(shape) == 2:
            why += (": a row only partly in the range is a box of its own, of 1 row, from "
                    "the range's first column in the first row and up to its last column "
                    "in the last row; only the rows in between are whole")
        return why
    parts = ([f"they leave out elements {spans(missing)}"] if missing else []) + \
            ([f"cover elements {spans(extra)}, outside the range"] if extra else [])
    return f"{say}; " + " and ".join(parts)
