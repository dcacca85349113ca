"""Lab 03: sharding the model state across data-parallel ranks.

- :mod:`~course_lib.fsdp.zero1`: :class:`ShardedOptimizer` (ZeRO-1: optimizer state sharded)
- :mod:`~course_lib.fsdp.zero2`: :class:`ZeRO2` (gradients reduce-scattered and sharded too)
- :mod:`~course_lib.fsdp.wrap`: wrap policies and the unit plan (data)
- :mod:`~course_lib.fsdp.flat_param`: one unit's parameters flattened, padded and sharded
- :mod:`~course_lib.fsdp.fsdp`: :class:`FSDP`, units gathered just in time, prefetched
- :mod:`~course_lib.fsdp.unit`: the same idea in one page (an autograd all-gather and
  saved-tensor hooks), the version Lab 03's exercises build
"""
from course_lib.fsdp.fsdp import FSDP, SHARDINGS, prefetch_targets
from course_lib.fsdp.unit import ShardedUnit, shard_model
from course_lib.fsdp.wrap import by_size, by_type, plan_units
from course_lib.fsdp.zero1 import ShardedOptimizer
from course_lib.fsdp.zero2 import ZeRO2

__all__ = ["FSDP", "SHARDINGS", "prefetch_targets", "ShardedUnit", "shard_model",
           "ShardedOptimizer", "ZeRO2", "by_size", "by_type", "plan_units"]
