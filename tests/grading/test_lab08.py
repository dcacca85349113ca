"""Lab 08's checks of Exercises 8.1 and 8.2: pass the solutions (also as the gradebook's
judge decides), fail the stubs and these plausible wrong answers, each with its reason;
the library's own functions pass the check's comparison and are refused by the judge."""
import random
import pytest

from conftest import judged, ship_by_value
from course_lib.checkpoint import boxes as library
from course_lib.grading import checks, lab08

ship_by_value(__name__)


# ---- 8.1: a flat range as boxes ------------------------------------------------------------
def boxes_of_flat_range(shape, start, length, aligned=False, per_row=False, end_shift=0,
                        last_first=False, column0=False, keep_empty=False):
    if length == 0:
        return []
    end = start + length + end_shift
    if len(shape) == 1:
        return [((start,), (end - start,))]
    cols = shape[1]
    first, last = start // cols, (end - 1) // cols
    if aligned:  # whole rows from the first to the last touched
        return [((first, 0), (last - first + 1, cols))]
    column = 0 if column0 else start % cols
    if first == last:
        return [((first, column), (1, end - start))]
    head = [((first, column), (1, cols - start % cols))] if start % cols else []
    lo, hi = first + (1 if start % cols else 0), last + (0 if end % cols else 1)
    if per_row:
        middle = [((r, 0), (1, cols)) for r in range(lo, hi)]
    else:
        middle = [((lo, 0), (hi - lo, cols))] if hi > lo or keep_empty else []
    tail = [((last, 0), (1, end % cols))] if end % cols else []
    return head + tail + middle if last_first else head + middle + tail


def other_decomposition(shape, start, length):
    """Whole rows cut in two boxes: equivalent, and within 3 boxes where it fits."""
    boxes = boxes_of_flat_range(shape, start, length)
    if len(boxes) == 1 and len(shape) == 2 and boxes[0][1][0] > 1:
        (r, c), (k, w) = boxes[0]
        return [((r, c), (1, w)), ((r + 1, c), (k - 1, w))]
    return boxes


def test_flat_range_passes_as_judged(sandbox):
    assert "1-column matrices" in judged(sandbox, lab08.check_flat_range_boxes,
                                         boxes_of_flat_range, seed=7)


def test_an_equivalent_decomposition_passes(capsys):
    lab08.check_flat_range_boxes(other_decomposition)
    assert "✓ Exercise 8.1 passed" in capsys.readouterr().out


@pytest.mark.parametrize("options, reason", [
    (dict(aligned=True), r"elements 6, 10..11, which are outside .*a row only partly in the "
                         r"range is a box of its own"),
    (dict(per_row=True), "the whole rows in the middle are one box"),
    (dict(end_shift=-1), "the last element, 7, is missing"),
    (dict(end_shift=1), "one element too many, element 8"),
    (dict(last_first=True), "the right elements in the wrong order: your boxes begin at "
                            "elements 4, 18, 6"),
    (dict(column0=True), "your first box begins at column 0 of row 1.*start % 6 = 1"),
    (dict(keep_empty=True), r"sizes \(0, 6\).*leave empty ones out"),
])
def test_flat_range_wrong_answers(options, reason):
    with pytest.raises(checks.CheckFailed, match=reason) as failed:
        lab08.check_flat_range_boxes(lambda *a: boxes_of_flat_range(*a, **options))
    assert str(failed.value).startswith("Exercise 8.1: boxes_of_flat_range(")
    assert "one right answer is" in str(failed.value)


@pytest.mark.parametrize("wrong, reason", [
    (lambda s, a, n: None if n == 0 else boxes_of_flat_range(s, a, n), r"no boxes: \[\]"),
    (lambda s, a, n: [(b[0], b[1][0]) for b in boxes_of_flat_range(s, a, n)],
     r"is not \(offsets, sizes\) with 1 whole numbers"),
    (lambda s, a, n: [((a,), (1,))] * n if len(s) == 1 else boxes_of_flat_range(s, a, n),
     "cover elements 3 more than once"),
    (lambda s, a, n: [((a + i,), (1,)) for i in range(n)] if len(s) == 1
     else boxes_of_flat_range(s, a, n), r"a range of a vector is one box: \(\(3,\), \(5,\)\)"),
    (lambda s, a, n: [((0,), (a + n + 5,))] if len(s) == 1 else boxes_of_flat_range(s, a, n),
     r"does not fit in shape \(10,\)"),
])
def test_flat_range_malformed_answers(wrong, reason):
    with pytest.raises(checks.CheckFailed, match=reason):
        lab08.check_flat_range_boxes(wrong)


# ---- 8.2: overlap and byte runs ------------------------------------------------------------
def overlap(box_a, box_b, touching_is_empty=False, corners=False):
    (oa, za), (ob, zb) = box_a, box_b
    lo = tuple(max(a, b) for a, b in zip(oa, ob))
    hi = tuple(min(a + s, b + t) for a, s, b, t in zip(oa, za, ob, zb))
    if any(h < l if touching_is_empty else h <= l for l, h in zip(lo, hi)):
        return None
    return (lo, hi) if corners else (lo, tuple(h - l for l, h in zip(lo, hi)))


def byte_ranges(stored, wanted, element_size, in_elements=False, global_offsets=False,
                merge=True, wanted_stride=False):
    (so, sz), (wo, wz) = stored, wanted
    size = 1 if in_elements else element_size
    base = (0,) * len(so) if global_offsets else so
    if len(sz) == 1:
        return [((wo[0] - base[0]) * size, wz[0] * size)]
    first = (wo[0] - base[0]) * sz[1] + (wo[1] - base[1])
    step = wz[1] if wanted_stride else sz[1]
    runs = []
    for r in range(wz[0]):
        at = (first + r * step) * size
        if merge and runs and runs[-1][0] + runs[-1][1] == at:
            runs[-1] = (runs[-1][0], runs[-1][1] + wz[1] * size)
        else:
            runs.append((at, wz[1] * size))
    return runs


def test_overlap_and_runs_pass_as_judged(sandbox):
    assert "element sizes 2, 4 and 8" in judged(sandbox, lab08.check_overlap_and_runs,
                                                overlap, byte_ranges, seed=7)
    for seed in range(20):  # the gradebook's hidden boxes
        lab08.check_overlap_and_runs(overlap, byte_ranges,
                                     **lab08.check_overlap_and_runs.hidden(random.Random(seed)))


@pytest.mark.parametrize("overlap_options, runs_options, reason", [
    (dict(touching_is_empty=True), {}, r"an empty box \(sizes \(0,\)\) is not an answer"),
    (dict(corners=True), {}, r"that is \(start, end\).*sizes = end - start"),
    ({}, dict(in_elements=True), r"in bytes: .* by element_size \(4\)"),
    ({}, dict(global_offsets=True), r"subtract the stored box's offsets \(5,\)"),
    ({}, dict(merge=False), "must be merged into one run.*here 2 runs are 1"),
    ({}, dict(wanted_stride=True), r"step by the stored box's width \(6 elements\), not by "
                                   r"the wanted box's \(2\)"),
])
def test_overlap_and_runs_wrong_answers(overlap_options, runs_options, reason):
    with pytest.raises(checks.CheckFailed, match=reason) as failed:
        lab08.check_overlap_and_runs(lambda a, b: overlap(a, b, **overlap_options),
                                     lambda s, w, e: byte_ranges(s, w, e, **runs_options))
    assert str(failed.value).startswith("Exercise 8.2: ")


def test_an_overlap_that_misses_a_partial_overlap_is_told_they_share_elements():
    def contained_only(a, b):
        inside = all(oa <= ob and ob + zb <= oa + za for oa, za, ob, zb in zip(*a, *b))
        return b if inside else None

    with pytest.raises(checks.CheckFailed, match="these boxes share elements"):
        lab08.check_overlap_and_runs(contained_only, byte_ranges)


# ---- the stubs, and the library ------------------------------------------------------------
def test_stubs_say_not_implemented():
    def stub(*args, **kwargs):
        raise NotImplementedError

    for call, ex in [(lambda: lab08.check_flat_range_boxes(stub), "8.1"),
                     (lambda: lab08.check_overlap_and_runs(stub, stub), "8.2"),
                     (lambda: lab08.check_overlap_and_runs(overlap, stub), "8.2")]:
        with pytest.raises(NotImplementedError, match=f"Exercise {ex} is not implemented"):
            call()


def test_the_library_passes_the_comparison(capsys):
    lab08.check_flat_range_boxes(library.boxes_of_flat_range)
    lab08.check_overlap_and_runs(library.overlap, library.byte_ranges)
    out = capsys.readouterr().out
    assert "✓ Exercise 8.1 passed" in out and "✓ Exercise 8.2 passed" in out


@pytest.mark.parametrize("check, student", [
    (lab08.check_flat_range_boxes, (library.boxes_of_flat_range,)),
    (lab08.check_overlap_and_runs, (library.overlap, library.byte_ranges)),
    (lab08.check_overlap_and_runs, (overlap, lambda s, w, e: library.byte_ranges(s, w, e))),
])
def test_the_library_is_refused(sandbox, check, student):
    with pytest.raises(checks.CheckFailed, match="course_lib's own implementation"):
        judged(sandbox, check, *student)
