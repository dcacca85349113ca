"""Exercise 8.4's check: a resharding load's fill_box passes (also as the judge decides),
the stub and each plausible wrong answer fail with their reasons."""
from pathlib import Path

import pytest
import torch

from conftest import judged, ship_by_value
from course_lib.checkpoint import byte_ranges, overlap
from course_lib.checkpoint.files import dtype_of
from course_lib.grading import checks
from course_lib.grading.lab08.loading import check_resharding_load

ship_by_value(__name__)


def _runs(stored, common, size):
    return [(0, size)] if not stored[1] else byte_ranges(stored, common, size)


def _block(path, piece, stored, common, dtype, base=None):
    size = torch.empty((), dtype=dtype).element_size()
    chunks = []
    with open(Path(path) / piece["file"], "rb") as f:
        for start, length in _runs(stored, common, size):
            f.seek((piece["byte_offset"] if base is None else base) + start)
            chunks.append(f.read(length))
    data = b"".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(common[1]), len(data)


def fill_box(path, entry, destination, box, first_only=False, base=None, global_slices=False):
    dtype, read = dtype_of(entry["dtype"]), 0
    for piece in entry["pieces"]:
        stored = (tuple(piece["offsets"]), tuple(piece["sizes"]))
        common = overlap(stored, box)
        if common is None:
            continue
        block, n = _block(path, piece, stored, common, dtype, base)
        lo = common[0] if global_slices else [o - b for o, b in zip(common[0], box[0])]
        destination[tuple(slice(o, o + z) for o, z in zip(lo, common[1]))] = block
        read += n
        if first_only:
            break
    return read


def first_piece_only(path, entry, destination, box):
    return fill_box(path, entry, destination, box, first_only=True)


def no_byte_offset(path, entry, destination, box):
    return fill_box(path, entry, destination, box, base=0)


def global_offsets(path, entry, destination, box):
    return fill_box(path, entry, destination, box, global_slices=True)


def returns_nothing(path, entry, destination, box):
    fill_box(path, entry, destination, box)
    return 0


def test_the_solution_passes_as_judged(sandbox):
    assert "equal to DCP" in judged(sandbox, check_resharding_load, fill_box, seed=7)


@pytest.mark.slow  # a 4-rank job each: CI runs them after make test
@pytest.mark.parametrize("wrong, reason", [
    (first_piece_only, "left unfilled"),
    (no_byte_offset, "byte_offset"),
    (returns_nothing, "returned 0 bytes read"),
])
def test_wrong_answers_fail_with_their_reason(wrong, reason):
    with pytest.raises(checks.CheckFailed, match="Exercise 8.4") as info:
        check_resharding_load(wrong)
    assert reason in str(info.value)


@pytest.mark.slow
def test_global_offsets_in_the_destination_fail():
    # slices at the overlap's global offsets land outside a box that does not start at 0:
    # either an error from the slice assignment or a box left unfilled
    with pytest.raises(checks.CheckFailed, match="Exercise 8.4"):
        check_resharding_load(global_offsets)


def test_the_stub_says_not_implemented():
    def stub(*args):
        raise NotImplementedError

    with pytest.raises(NotImplementedError, match="Exercise 8.4 is not implemented"):
        check_resharding_load(stub)


def test_the_library_is_refused(sandbox):
    from course_lib.checkpoint.load import fill_box as library_fill

    with pytest.raises(checks.CheckFailed, match="course_lib.s own implementation"):
        judged(sandbox, check_resharding_load, library_fill)
