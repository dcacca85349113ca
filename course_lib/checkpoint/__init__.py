"""Sharded checkpoints (Lab 08): save what each rank holds, load it into any layout.

- :mod:`~course_lib.checkpoint.boxes`: a rank's piece of a tensor as boxes, a flat
  range as boxes, the overlap of two boxes and the bytes a load reads.
"""
from course_lib.checkpoint.boxes import ShardedTensor, boxes_of_flat_range, byte_ranges, overlap

__all__ = ["ShardedTensor", "boxes_of_flat_range", "overlap", "byte_ranges"]
