"""Lab 03: memory you can predict (formulas) and measure (allocator).

- :mod:`~course_lib.memory.estimate`: P, ZeRO stage bytes, activations, FSDP peak, OLMo table
- :mod:`~course_lib.memory.measure`: model-state bytes of a model and optimizer, peak bytes
- :mod:`~course_lib.memory.checkpointing`: activation checkpointing, its memory and time measured
- :mod:`~course_lib.memory.precision`: bytes per parameter of each mixed-precision recipe, fp32 masters
- :mod:`~course_lib.memory.loss_scaling`: a fixed and a dynamic fp16 loss scale, on a run that overflows
- :mod:`~course_lib.memory.ring_precision`: how far a bf16 ring all-reduce drifts as ranks grow
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
