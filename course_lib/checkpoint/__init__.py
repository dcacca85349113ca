"""Sharded checkpoints (Lab 08): save what each rank holds, load it into any layout.

- :mod:`~course_lib.checkpoint.boxes`: a rank's piece of a tensor as boxes, a flat
  range as boxes, the overlap of two boxes and the bytes a load reads;
- :mod:`~course_lib.checkpoint.files`: the files of a checkpoint, written atomically;
- :mod:`~course_lib.checkpoint.save`: every rank writes its boxes, rank 0 the index and
  the commit marker; :func:`latest` finds the newest committed one;
- :mod:`~course_lib.checkpoint.load`: any layout from any saved one, reading only the
  bytes each rank needs; :func:`consolidate` makes whole tensors in one process.
"""
from course_lib.checkpoint.boxes import ShardedTensor, boxes_of_flat_range, byte_ranges, overlap
from course_lib.checkpoint.files import CheckpointError
from course_lib.checkpoint.load import consolidate, load
from course_lib.checkpoint.save import latest, save

__all__ = ["ShardedTensor", "boxes_of_flat_range", "overlap", "byte_ranges", "save", "load",
           "latest", "consolidate", "CheckpointError"]
