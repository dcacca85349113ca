"""Lab 02: distributed data parallelism, from the naive version to torch's design.

- :mod:`~course_lib.ddp.naive`: :class:`NaiveDDP` (one all-reduce per gradient) and
  :class:`FlatDDP` (one all-reduce of everything), both after backward
- :mod:`~course_lib.ddp.buckets`: the bucket plan (pure data) and the flat buffers
- :mod:`~course_lib.ddp.bucketed`: :class:`DDP`, buckets all-reduced during backward
- :mod:`~course_lib.ddp.comm_hooks`: what DDP does with a bucket, as torch's
  ``register_comm_hook`` (all-reduce, bf16 compression)
- :mod:`~course_lib.ddp.traffic`: bytes per step, DataParallel's GPU 0 against a DDP rank
- :mod:`~course_lib.ddp.frameworks`: the same run under PyTorch Lightning and ours
"""
from course_lib.ddp import comm_hooks
from course_lib.ddp.bucketed import DDP
from course_lib.ddp.buckets import Bucket, assign_buckets
from course_lib.ddp.naive import FlatDDP, NaiveDDP

__all__ = ["DDP", "NaiveDDP", "FlatDDP", "Bucket", "assign_buckets", "comm_hooks"]
