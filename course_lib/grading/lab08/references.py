"""What Lab 08's checks compare with, worked out in the checking process element by
element (never with course_lib.checkpoint.boxes, which is what the student rewrites).

- 8.1: the flat ranges of each case, the elements a list of boxes covers (enumerated
  box by box in row-major order) and one right decomposition, for the messages;
- 8.2: pairs of boxes and their overlap, per dimension; the byte runs of a wanted box
  inside a stored one, from the position of each of its elements in the stored array.
"""
from __future__ import annotations

import math
import numbers

import torch

# ---- plain boxes --------------------------------------------------------------------------
def as_int(value):
    """``value`` as an int (a numpy integer or an integer 0-d tensor too), or None."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        return int(value.item())
    return None


def as_box(value, ndim):
    """``value`` as ((offsets), (sizes)) of ``ndim`` ints each, or None if it is not one."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return None
    parts = []
    for part in value:
        if isinstance(part, torch.Tensor):
            part = part.tolist() if part.dim() == 1 else None
        if not isinstance(part, (tuple, list)) or len(part) != ndim:
            return None
        ints = tuple(as_int(v) for v in part)
        if any(v is None for v in ints):
            return None
        parts.append(ints)
    return tuple(parts)


def elements(box, shape):
    """The flat indices of ``box`` in a tensor of ``shape`` (1 or 2 dims), row-major."""
    (offsets, sizes) = box
    if len(shape) == 1:
        return list(range(offsets[0], offsets[0] + sizes[0]))
    return [r * shape[1] + c for r in range(offsets[0], offsets[0] + sizes[0])
            for c in range(offsets[1], offsets[1] + sizes[1])]


def spans(values):
    """Sorted ints as "0..3, 7, 21..23"."""
    out, values = [], sorted(set(values))
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(f"{values[i]}" if i == j else f"{values[i]}..{values[j]}")
        i = j + 1
    return ", ".join(out)


# ---- 8.1: a flat range as boxes ---------------------------------------------------------------
# (what is special, shape, start, length)
FLAT_CASES = [
    ("a vector", (10,), 3, 5),
    ("a range inside one row", (4, 6), 7, 3),
    ("exactly whole rows", (4, 6), 6, 12),
    ("mid-row to mid-row three rows later", (5, 6), 4, 17),
    ("mid-row to mid-row of the next row", (4, 6), 4, 5),
    ("from a row boundary to mid-row", (4, 6), 6, 10),
    ("from mid-row to a row boundary", (4, 6), 3, 9),
    ("length 0", (4, 6), 5, 0),
    ("the whole tensor", (4, 6), 0, 24),
    ("a whole vector", (7,), 0, 7),
    ("a matrix of 1 row", (1, 8), 2, 5),
    ("a matrix of 1 column", (7, 1), 2, 4),
]


def drawn_flat_cases(rng, count=6):
    """The gradebook's hidden ranges: shapes and offsets the notebook does not show."""
    cases = []
    for _ in range(count):
        shape = (rng.randint(2, 40),) if rng.random() < 0.25 else \
            (rng.randint(2, 9), rng.randint(2, 13))
        numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
        start = rng.randint(0, numel - 1)
        cases.append(("a drawn range", shape, start, rng.randint(1, numel - start)))
    return tuple(cases)


def most_boxes(shape):
    return 1 if len(shape) == 1 else 3


def flat_boxes(shape, start, length):
    """One right answer: a partial first row, the whole rows, a partial last row."""
    end = start + length
    if length == 0:
        return []
    if len(shape) == 1:
        return [((start,), (length,))]
    cols = shape[1]
    first, last = start // cols, (end - 1) // cols
    if first == last:
        return [((first, start % cols), (1, length))]
    boxes, whole_from, whole_to = [], first, last + 1
    if start % cols:
        boxes.append(((first, start % cols), (1, cols - start % cols)))
        whole_from += 1
    if end % cols:
        whole_to -= 1
    if whole_to > whole_from:
        boxes.append(((whole_from, 0), (whole_to - whole_from, cols)))
    if end % cols:
        boxes.append(((last, 0), (1, end % cols)))
    return boxes


# ---- 8.2: overlaps and byte runs ------------------------------------------------------------
# (box_a, box_b): the expected overlap is worked out per dimension by :func:`overlap_of`
OVERLAP_CASES = [
    (((0,), (4,)), ((6,), (3,))),                      # 1-D, disjoint
    (((0,), (10,)), ((2,), (3,))),                     # contained
    (((0,), (4,)), ((4,), (3,))),                      # touching: no element in common
    (((0,), (5,)), ((3,), (4,))),                      # partial
    (((0, 0), (2, 6)), ((1, 3), (3, 3))),              # 2-D, partial
    (((0, 0), (4, 3)), ((0, 3), (4, 3))),              # side by side, touching
    (((0, 0), (2, 2)), ((2, 2), (2, 2))),              # touching at a corner
    (((0, 0), (2, 2)), ((0, 5), (2, 2))),              # apart in one dimension only
    (((1, 2), (3, 4)), ((1, 2), (3, 4))),              # identical
    (((2, 3), (1, 4)), ((0, 0), (8, 8))),              # contained, the container second
    (((0, 0, 0), (2, 4, 6)), ((1, 2, 3), (4, 4, 4))),  # 3-D, partial
    (((0, 0, 0), (2, 2, 2)), ((0, 0, 2), (2, 2, 2))),  # touching in the last dimension
    (((1, 1, 1), (2, 2, 2)), ((0, 0, 0), (4, 4, 4))),  # contained
]


def drawn_boxes(rng):
    """The gradebook's hidden overlaps and reads: boxes in 1 to 3 dimensions, drawn."""
    def box(ndim, within=None):
        if within is None:
            return (tuple(rng.randint(0, 6) for _ in range(ndim)),
                    tuple(rng.randint(1, 6) for _ in range(ndim)))
        offsets = [rng.randint(o, o + s - 1) for o, s in zip(*within)]
        return (tuple(offsets), tuple(rng.randint(1, o + s - p)
                                      for p, o, s in zip(offsets, *within)))

    pairs = tuple((box(n), box(n)) for n in (rng.randint(1, 3) for _ in range(4)))
    reads = []
    for ndim in (1, 2, 2):
        stored = box(ndim)
        reads.append((stored, box(ndim, within=stored), rng.choice((2, 4, 8))))
    return {"pairs": pairs, "reads": tuple(reads)}


def overlap_of(box_a, box_b):
    (oa, za), (ob, zb) = box_a, box_b
    lo = [max(a, b) for a, b in zip(oa, ob)]
    hi = [min(a + s, b + t) for a, s, b, t in zip(oa, za, ob, zb)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - l for l, h in zip(lo, hi))


# (stored, wanted, element_size)
RUN_CASES = [
    (((0,), (10,)), ((3,), (4,)), 4),                  # 1-D
    (((5,), (10,)), ((7,), (3,)), 8),                  # 1-D, stored at an offset
    (((0, 0), (4, 6)), ((0, 2), (4, 2)), 4),           # a column strip: a run per row
    (((0, 0), (4, 6)), ((1, 0), (2, 6)), 4),           # whole rows: one run
    (((0, 0), (3, 5)), ((2, 4), (1, 1)), 2),           # a single element
    (((2, 3), (3, 4)), ((2, 3), (3, 4)), 4),           # the whole stored box
    (((0, 0), (2, 6)), ((1, 3), (1, 3)), 4),           # part of one row
    (((4, 10), (3, 5)), ((5, 11), (2, 3)), 2),         # a strip of a box stored at (4, 10)
    (((0, 0), (3, 4)), ((0, 1), (3, 2)), 8),           # a strip, 8-byte elements
    (((8, 0), (4, 3)), ((9, 0), (3, 3)), 8),           # whole rows to the end, at an offset
]


def _runs(positions, element_size):
    runs = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return [(p * element_size, n * element_size) for p, n in runs]


def _positions(stored, wanted, row_stride=None, global_offsets=False):
    """Where each element of ``wanted`` (row-major) sits in ``stored``'s array; the
    mistakes: rows ``row_stride`` apart, or offsets not made relative to ``stored``."""
    (so, sz), (wo, wz) = stored, wanted
    base = [0] * len(so) if global_offsets else so
    strides = [math.prod(sz[d + 1:]) for d in range(len(sz))]
    if len(sz) == 1:
        return [wo[0] - base[0] + i for i in range(wz[0])]
    first = (wo[0] - base[0]) * strides[0] + (wo[1] - base[1])
    step = strides[0] if row_stride is None else row_stride
    return [first + r * step + c for r in range(wz[0]) for c in range(wz[1])]


def runs_of(stored, wanted, element_size):
    """The byte runs of ``wanted`` in ``stored``'s row-major array, consecutive ones merged."""
    return _runs(_positions(stored, wanted), element_size)


def mistaken_runs(stored, wanted, element_size):
    """{mistake: the runs it gives} for the known mistakes of byte_ranges."""
    return {"elements": _runs(_positions(stored, wanted), 1),
            "global": _runs(_positions(stored, wanted, global_offsets=True), element_size),
            "wanted stride": _runs(_positions(stored, wanted, row_stride=wanted[1][-1]),
                                   element_size)}


def merged(runs):
    """``runs`` with touching ones joined (what a student's unmerged runs cover)."""
    out = []
    for offset, length in runs:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((offset, length))
    return out
