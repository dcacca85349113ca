"""Exercise 8.2's check: the overlap of two boxes (a box, or None where they share no
element) and the byte runs a load reads from a stored box's contiguous row-major data
to get a wanted box inside it (in order, consecutive runs merged), both called in the
student's process and judged against :mod:`.references` (per dimension, and element by
element)."""
from __future__ import annotations

from course_lib.grading import checks
from course_lib.grading.lab08 import references
from course_lib.grading.lab08.references import as_box, as_int, merged
from course_lib.grading.requests import call_each, here

EX_RUNS = "Exercise 8.2"


@checks.check(EX_RUNS, hidden=references.drawn_boxes)
def check_overlap_and_runs(overlap, byte_ranges, pairs=tuple(references.OVERLAP_CASES),
                           reads=tuple(references.RUN_CASES)):
    ex = EX_RUNS
    answers = yield here(call_each, overlap, [((a, b), {}) for a, b in pairs])
    for (a, b), answer in zip(pairs, answers):
        call = f"overlap({a}, {b})"
        got = checks.answer_value(ex, call, answer)
        want = references.overlap_of(a, b)
        why = _overlap_mistake(got, want, len(a[0]))
        if why:
            raise checks.CheckFailed(f"{ex}: {call} returned {got!r}; expected {want}.\n"
                                     f"Why: {why}")
    answers = yield here(call_each, byte_ranges, [((s, w, size), {}) for s, w, size in reads])
    for (stored, wanted, size), answer in zip(reads, answers):
        call = f"byte_ranges({stored}, {wanted}, element_size={size})"
        got = checks.answer_value(ex, call, answer)
        want = references.runs_of(stored, wanted, size)
        why = _runs_mistake(got, want, stored, wanted, size)
        if why:
            raise checks.CheckFailed(f"{ex}: {call} returned {got!r}; expected {want}.\n"
                                     f"Why: {why}")
    return (f"{len(pairs)} overlaps in 1 to 3 dimensions (touching boxes included), "
            f"{len(reads)} reads in 1 and 2 dimensions, element sizes 2, 4 and 8")


def _overlap_mistake(got, want, ndim):
    box = as_box(got, ndim)
    if want is None:
        if got is None:
            return None
        if box is not None and any(z <= 0 for z in box[1]):
            return (f"these boxes share no element (they touch or lie apart), and an empty "
                    f"box (sizes {box[1]}) is not an answer: return None when the overlap's "
                    f"size is 0 or less in any dimension")
        return ("these boxes share no element: in some dimension one ends before the other "
                "starts (offset + size <= the other's offset): return None")
    if got is None:
        return ("these boxes share elements: the overlap starts at the larger of the two "
                "offsets and ends at the smaller of the two ends (offset + size), in every "
                "dimension; it is None only where that end is not past that start")
    if box is None:
        return (f"return a box, (offsets, sizes) with {ndim} whole numbers each "
                f"(the boxes have {ndim} dimensions), or None")
    if box == want:
        return None
    if box[0] == want[0] and box[1] == tuple(o + z for o, z in zip(*want)):
        return ("that is (start, end), the first corner and one past the last: a box is "
                "(offsets, sizes), sizes = end - start")
    return ("in every dimension, the overlap starts at max(offset_a, offset_b) and ends at "
            "min(offset_a + size_a, offset_b + size_b); its size is end - start")


def _runs_mistake(got, want, stored, wanted, size):
    runs = _as_runs(got)
    if runs is None:
        return ("return a list of (byte offset, byte length) pairs of whole numbers, one per "
                "contiguous run, in order")
    if runs == want:
        return None
    known = references.mistaken_runs(stored, wanted, size)
    if runs == known["elements"]:
        return (f"in bytes: multiply the offsets and lengths, counted in elements, by "
                f"element_size ({size})")
    if merged(runs) == want:
        return (f"runs that touch (one ends where the next starts) must be merged into one "
                f"run, a single read: here {len(runs)} runs are {len(want)} (whole rows of "
                f"the stored box are one run)")
    if len(stored[1]) == 2 and merged(runs) == merged(known["wanted stride"]):
        return (f"the wanted box's rows lie a whole stored row apart in the stored array: "
                f"step by the stored box's width ({stored[1][1]} elements), not by the "
                f"wanted box's ({wanted[1][1]})")
    if merged(runs) == merged(known["global"]):
        return (f"offsets count from the start of the stored box's own data, not of the "
                f"whole tensor: subtract the stored box's offsets {stored[0]} from the "
                f"wanted box's before taking the position")
    return ("a run starts at the position, in the stored box's row-major array, of the "
            "first element of a row of the wanted box: ((row - stored row offset) x stored "
            "width + (column - stored column offset)) x element_size, and is that row's "
            "width x element_size long; runs that touch are merged")


def _as_runs(got):
    if not isinstance(got, (list, tuple)):
        return None
    runs = []
    for run in got:
        if not isinstance(run, (list, tuple)) or len(run) != 2:
            return None
        offset, length = (as_int(v) for v in run)
        if offset is None or length is None:
            return None
        runs.append((offset, length))
    return runs
