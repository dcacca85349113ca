"""Lab 03: memory you can predict (formulas) and measure (allocator).

- :mod:`~course_lib.memory.estimate`: P, ZeRO stage bytes, activations, FSDP peak, OLMo table
- :mod:`~course_lib.memory.measure`: model-state bytes of a model and optimizer, peak bytes
- :mod:`~course_lib.memory.checkpointing`: activation checkpointing, its memory and time measured
"""
from course_lib.memory.estimate import (OLMO, ModelShape, activation_bytes,
                                        activation_bytes_megatron, fsdp_peak_param_bytes,
                                        gpus_needed, memory_table, model_state_bytes,
                                        other_bytes, param_count, piece_params)
from course_lib.memory.checkpointing import checkpoint_blocks, compare_checkpointing
from course_lib.memory.measure import model_state_bytes_of, peak_bytes

__all__ = ["OLMO", "ModelShape", "activation_bytes", "activation_bytes_megatron",
           "fsdp_peak_param_bytes", "gpus_needed",
           "memory_table", "model_state_bytes", "other_bytes", "param_count", "piece_params",
           "model_state_bytes_of", "peak_bytes", "checkpoint_blocks", "compare_checkpointing"]
