"""Lab 03: sharding the model state across data-parallel ranks.

- :mod:`~course_lib.fsdp.zero1`: :class:`ShardedOptimizer` (ZeRO-1: optimizer state sharded)
- :mod:`~course_lib.fsdp.wrap`: wrap policies and the unit plan (data)
- :mod:`~course_lib.fsdp.flat_param`: one unit's parameters flattened, padded and sharded
- :mod:`~course_lib.fsdp.fsdp`: :class:`FSDP`, units gathered just in time
"""
from course_lib.fsdp.fsdp import FSDP, SHARDINGS
from course_lib.fsdp.wrap import by_size, by_type, plan_units
from course_lib.fsdp.zero1 import ShardedOptimizer

__all__ = ["FSDP", "SHARDINGS", "ShardedOptimizer", "by_size", "by_type", "plan_units"]
