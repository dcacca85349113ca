"""The geometry of sharded checkpoints against brute force on small tensors: the boxes of
a flat range cover exactly its elements, an overlap is the elements both boxes hold, and
byte ranges read exactly the overlap's bytes from a stored box."""
import math
import random

import pytest
import torch

from course_lib.checkpoint.boxes import (ShardedTensor, boxes_of_flat_range, byte_ranges,
                                         overlap)


def _mask(shape, box):
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[tuple(slice(o, o + z) for o, z in zip(*box))] = True
    return mask


SHAPES = [(7,), (4, 6), (3, 1, 5), (2, 3, 4, 5), (5, 1), (1, 9)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_boxes_of_a_flat_range_are_exactly_its_elements(shape):
    rng = random.Random(0)
    total = math.prod(shape)
    for _ in range(40):
        start = rng.randrange(total + 1)
        length = rng.randrange(total - start + 1)
        boxes = boxes_of_flat_range(shape, start, length)
        flat = torch.zeros(total, dtype=torch.int64)
        for box in boxes:
            flat += _mask(shape, box).flatten()
        want = torch.zeros(total, dtype=torch.int64)
        want[start:start + length] = 1
        assert torch.equal(flat, want), (shape, start, length, boxes)
        values = torch.arange(total).reshape(shape)
        got = torch.cat([values[tuple(slice(o, o + z) for o, z in zip(*b))].flatten()
                         for b in boxes]) if boxes else torch.empty(0, dtype=torch.int64)
        assert got.tolist() == list(range(start, start + length))  # in flat order
        if len(shape) == 2:
            assert len(boxes) <= 3


def test_the_docstring_example_and_bad_ranges():
    assert boxes_of_flat_range((4, 6), 5, 9) == [((0, 5), (1, 1)), ((1, 0), (1, 6)),
                                                 ((2, 0), (1, 2))]
    assert boxes_of_flat_range((4, 6), 6, 12) == [((1, 0), (2, 6))]
    with pytest.raises(ValueError, match="not inside"):
        boxes_of_flat_range((4, 6), 20, 5)


def test_overlap_is_the_intersection():
    rng = random.Random(1)
    shape = (6, 5, 4)
    for _ in range(200):
        boxes = []
        for _ in range(2):
            o = tuple(rng.randrange(g) for g in shape)
            boxes.append((o, tuple(rng.randint(1, g - x) for g, x in zip(shape, o))))
        both = _mask(shape, boxes[0]) & _mask(shape, boxes[1])
        got = overlap(*boxes)
        if not both.any():
            assert got is None
        else:
            assert torch.equal(_mask(shape, got), both)


def test_byte_ranges_read_exactly_the_overlap():
    rng = random.Random(2)
    shape = (5, 4, 6)
    values = torch.arange(math.prod(shape), dtype=torch.int32).reshape(shape)
    for _ in range(100):
        o = tuple(rng.randrange(g) for g in shape)
        stored = (o, tuple(rng.randint(1, g - x) for g, x in zip(shape, o)))
        o2 = tuple(rng.randrange(a, a + z) for a, z in zip(*stored))
        wanted = (o2, tuple(rng.randint(1, a + z - x) for a, z, x in zip(*stored, o2)))
        data = values[tuple(slice(a, a + z) for a, z in zip(*stored))].contiguous()
        raw = data.numpy().tobytes()
        runs = byte_ranges(stored, wanted, element_size=4)
        read = b"".join(raw[s:s + n] for s, n in runs)
        want = values[tuple(slice(a, a + z) for a, z in zip(*wanted))].contiguous()
        assert read == want.numpy().tobytes()
        assert sum(n for _, n in runs) == want.numel() * 4
        assert all(a[0] + a[1] < b[0] for a, b in zip(runs, runs[1:]))  # merged, in order
    assert byte_ranges(((), ()), ((), ()), 8) == [(0, 8)]  # a 0-d tensor: one element
    whole = ((0, 0, 0), shape)
    assert byte_ranges(whole, whole, 4) == [(0, values.numel() * 4)]
    with pytest.raises(ValueError, match="not inside"):
        byte_ranges(((0, 0, 0), (1, 1, 1)), ((0, 0, 0), (2, 1, 1)), 4)


def test_a_sharded_tensor_must_fit_its_global_shape():
    st = ShardedTensor(torch.zeros(2, 3), (4, 3), (2, 0))
    assert st.box == ((2, 0), (2, 3))
    with pytest.raises(ValueError, match="do not fit"):
        ShardedTensor(torch.zeros(3, 3), (4, 3), (2, 0))
    with pytest.raises(ValueError, match="must agree"):
        ShardedTensor(torch.zeros(3), (4, 3), (2, 0))
