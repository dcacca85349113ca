"""Sharded checkpoints (Lab 08): save what each rank holds, load it into any layout.

- :mod:`~course_lib.checkpoint.boxes`: a rank's piece of a tensor as boxes, a flat
  range as boxes, the overlap of two boxes and the bytes a load reads;
- :mod:`~course_lib.checkpoint.files`: the files of a checkpoint, written atomically;
- :mod:`~course_lib.checkpoint.save`: every rank writes its boxes, rank 0 the index and
  the commit marker; :func:`latest` finds the newest committed one;
- :mod:`~course_lib.checkpoint.load`: any layout from any saved one, reading only the
  bytes each rank needs; :func:`consolidate` makes whole tensors in one process;
- :mod:`~course_lib.checkpoint.async_save`: the loop waits for a copy, a thread writes;
- :mod:`~course_lib.checkpoint.pipeline`: PipeDream's per-stage checkpoints;
- :mod:`~course_lib.checkpoint.state`: the sharded state of a plain, DDP, FSDP or
  tensor-parallel model and its optimizer under the dense names; :func:`restore`.
"""
from course_lib.checkpoint.async_save import AsyncCheckpointer
from course_lib.checkpoint.boxes import ShardedTensor, boxes_of_flat_range, byte_ranges, overlap
from course_lib.checkpoint.files import CheckpointError
from course_lib.checkpoint.load import consolidate, load
from course_lib.checkpoint.pipeline import latest_complete, save_stage
from course_lib.checkpoint.save import latest, save
from course_lib.checkpoint.state import restore, state_of

__all__ = ["ShardedTensor", "boxes_of_flat_range", "overlap", "byte_ranges", "save", "load",
           "latest", "consolidate", "CheckpointError", "AsyncCheckpointer", "save_stage",
           "latest_complete", "state_of", "restore"]
