"""Where a rank's piece of a tensor sits in the whole: boxes, and what a load must read
(Lab 08: the geometry under a sharded checkpoint).

A rank's part of a global tensor of shape G is a **box**: offsets o and sizes z, the
elements x with o_d <= x_d < o_d + z_d in every dimension d. A row or column split
gives one box per rank; an FSDP shard, a flat range [start, start + length) of the
flattened tensor, is a few boxes (a partial row, whole rows, a partial row for a
matrix; one more pair per extra dimension). A checkpoint stores each saved box as a
contiguous row-major array; a load of another layout intersects each wanted box with
each saved one and reads, from the saved array, only the runs of the overlap::

    boxes_of_flat_range((4, 6), 5, 9)     # [((0, 5), (1, 1)), ((1, 0), (1, 6)), ((2, 0), (1, 2))]
    overlap(((0, 0), (2, 6)), ((1, 3), (3, 3)))     # ((1, 3), (1, 3))
    byte_ranges(((0, 0), (2, 6)), ((1, 3), (1, 3)), element_size=4)   # [(36, 12)]
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class ShardedTensor:
    """This rank's block ``local`` of a tensor of ``global_shape``, at ``offsets``."""
    local: torch.Tensor
    global_shape: tuple
    offsets: tuple

    def __post_init__(self):
        self.global_shape, self.offsets = tuple(self.global_shape), tuple(self.offsets)
        if len(self.offsets) != len(self.global_shape) or self.local.dim() != len(self.offsets):
            raise ValueError(f"a box of {self.local.dim()} dims at offsets {self.offsets} in a "
                             f"tensor of shape {self.global_shape}: the ranks must agree")
        for d, (o, z, g) in enumerate(zip(self.offsets, self.local.shape, self.global_shape)):
            if o < 0 or o + z > g:
                raise ValueError(f"dim {d}: rows {o}..{o + z - 1} do not fit in {g}")

    @property
    def box(self):
        return self.offsets, tuple(self.local.shape)


def is_sharded(value):
    """A state entry of boxes: one ShardedTensor, or a non-empty list of them."""
    return isinstance(value, ShardedTensor) or (
        isinstance(value, (list, tuple)) and bool(value)
        and all(isinstance(v, ShardedTensor) for v in value))


def map_state(state, fn, plain=lambda value: value):
    """``state`` with ``fn(t)`` in place of every tensor, a ShardedTensor's local block
    included (its box kept), and ``plain(v)`` in place of every plain value."""
    def entry(value):
        if isinstance(value, torch.Tensor):
            return fn(value)
        if isinstance(value, ShardedTensor):
            return ShardedTensor(fn(value.local), value.global_shape, value.offsets)
        if is_sharded(value):
            return [entry(v) for v in value]
        return plain(value)

    return {name: entry(value) for name, value in state.items()}


def boxes_of_flat_range(shape, start, length):
    """The boxes (offsets, sizes) covering elements [start, start + length) of a tensor of
    ``shape`` flattened row-major, in that order."""
    shape = tuple(shape)
    if start < 0 or length < 0 or start + length > math.prod(shape):
        raise ValueError(f"[{start}, {start + length}) is not inside {math.prod(shape)} "
                         f"elements of {shape}")
    if length == 0:
        return []
    return _boxes(shape, start, start + length)


def _boxes(shape, start, end):
    if len(shape) == 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    if first == last:  # inside one row: a range of the row's own elements
        return [((first, *o), (1, *z)) for o, z in _boxes(shape[1:], start - first * inner,
                                                           end - first * inner)]
    boxes = []
    whole_from, whole_to = first, last + 1
    if start % inner:  # a partial first row
        boxes += _boxes(shape, start, (first + 1) * inner)
        whole_from = first + 1
    if end % inner:  # a partial last row, after the whole ones
        whole_to = last
    if whole_to > whole_from:
        boxes.append(((whole_from, *[0] * (len(shape) - 1)),
                      (whole_to - whole_from, *shape[1:])))
    if end % inner:
        boxes += _boxes(shape, last * inner, end)
    return boxes


def overlap(box_a, box_b):
    """The box both ``box_a`` and ``box_b`` (each (offsets, sizes)) cover, or None."""
    (oa, za), (ob, zb) = box_a, box_b
    lo = tuple(max(a, b) for a, b in zip(oa, ob))
    hi = tuple(min(a + s, b + t) for a, s, b, t in zip(oa, za, ob, zb))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def byte_ranges(stored, wanted, element_size):
    """(offset, length) byte runs to read, in order, of the box ``wanted`` (inside
    ``stored``) from ``stored`` saved as one contiguous row-major array: one run per
    line of the wanted box along the innermost dimension it does not cover whole,
    merged where consecutive runs touch."""
    (so, sz), (wo, wz) = stored, wanted
    if overlap(stored, wanted) != (tuple(wo), tuple(wz)):
        raise ValueError(f"box {wanted} is not inside the stored box {stored}")
    if not sz:  # a 0-d tensor: one element
        return [(0, element_size)]
    strides = [math.prod(sz[d + 1:]) for d in range(len(sz))]
    # the dims after ``inner`` are whole in both boxes: a line along ``inner`` is then
    # one run of wz[inner] * strides[inner] elements (a whole-rows box is one run)
    inner = len(sz) - 1
    while inner > 0 and all(wz[d] == sz[d] for d in range(inner, len(sz))):
        inner -= 1
    length = wz[inner] * strides[inner] * element_size
    runs = []
    for index in _lines(wz[:inner]):
        first = sum((w + i - s) * st for w, i, s, st in
                    zip(wo, (*index, 0), so, strides[:inner + 1]))
        start = first * element_size
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + length)
        else:
            runs.append((start, length))
    return runs


def _lines(sizes):
    """Every index of a box of ``sizes`` (row-major order); one empty index for none."""
    if not sizes:
        yield ()
        return
    for i in range(sizes[0]):
        for rest in _lines(sizes[1:]):
            yield (i, *rest)
