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
  tensor-parallel model and its optimizer under the dense names; :func:`restore`;
- :mod:`~course_lib.checkpoint.meta_init`: init without the whole model: build on the
  meta device, shard (FSDP or TP), fill only this rank's slices of the dense init, one
  parameter at a time (:func:`meta_fsdp`, :func:`meta_tp`, :func:`materialize`);
- :mod:`~course_lib.checkpoint.resume`: what an exact resume needs besides the model
  (Adam's state, every rank's generator, the data position);
  :mod:`~course_lib.checkpoint.resumable`: a run that survives a killed rank;
- :mod:`~course_lib.checkpoint.goodput`: how often to save (Young's sqrt(2CM)) and a
  simulation of a run with failures;
- :mod:`~course_lib.checkpoint.dcp_reference`: the same state through
  torch.distributed.checkpoint, the reference a resharding load is checked against.
"""
from course_lib.checkpoint.async_save import AsyncCheckpointer
from course_lib.checkpoint.boxes import ShardedTensor, boxes_of_flat_range, byte_ranges, overlap
from course_lib.checkpoint.files import CheckpointError
from course_lib.checkpoint.goodput import (daly_interval, expected_goodput, goodput_sweep, simulate,
                                           young_interval)
from course_lib.checkpoint.load import consolidate, load
from course_lib.checkpoint.meta_init import LiveBytes, materialize, meta_fsdp, meta_gpt, meta_tp
from course_lib.checkpoint.pipeline import latest_complete, load_stages, plan_restart, save_stage
from course_lib.checkpoint.resume import (DataCursor, restore_training_state, resume_latest,
                                          training_state)
from course_lib.checkpoint.save import latest, save
from course_lib.checkpoint.state import restore, state_of

__all__ = ["ShardedTensor", "boxes_of_flat_range", "overlap", "byte_ranges", "save", "load",
           "latest", "consolidate", "CheckpointError", "AsyncCheckpointer", "save_stage",
           "latest_complete", "load_stages", "plan_restart", "state_of", "restore", "LiveBytes",
           "meta_gpt", "materialize",
           "meta_fsdp", "meta_tp", "DataCursor", "training_state", "restore_training_state",
           "resume_latest",
           "young_interval", "daly_interval", "expected_goodput", "simulate", "goodput_sweep"]
