"""Lab 05: tensor parallelism, Megatron's 1D split of every layer over t ranks.

- :mod:`~course_lib.tp.operators`: f (``copy_to_tp``) and its conjugate g
  (``reduce_from_tp``), ``split_to_tp`` / ``gather_from_tp``: autograd Functions
  whose collectives are counted and traced
- :mod:`~course_lib.tp.layers`: :class:`ColumnParallelLinear` (A = [A_1 ... A_t])
  and :class:`RowParallelLinear` (A = [A_1; ...; A_t]), from a dense layer or by name
- :mod:`~course_lib.tp.blocks`: :class:`ParallelMLP`, :class:`ParallelAttention`
  (split by heads), :class:`ParallelBlock` (a drop-in for the GPT's block), a
  sharding plan as data, :func:`parallelize_block`
- :mod:`~course_lib.tp.vocab`: :class:`VocabParallelEmbedding` and
  :func:`vocab_parallel_cross_entropy`: the vocabulary split, logits never gathered
- :mod:`~course_lib.tp.sequence`: sequence parallelism, the replicated parts split along
  s: all-gather / reduce-scatter in place of f / g (``parallelize_block(...,
  sequence_parallel=True)``)
- :mod:`~course_lib.tp.regions`: the local compute between f and g as timeline spans
- :mod:`~course_lib.tp.volume`: the analytic side: bytes per layer, Megatron's 1D
  grid against AxoNN-style 2D/3D grids, NVLink against InfiniBand

::

    tp = dims.group("tp")                        # or None: the whole world
    block = parallelize_block(Block(cfg), tp)    # 2 all-reduces forward, 2 backward
"""
from course_lib.tp.blocks import (BLOCK_PLAN, STYLES, ParallelAttention, ParallelBlock,
                                  ParallelMLP, parallelize, parallelize_block)
from course_lib.tp.layers import ColumnParallelLinear, RowParallelLinear, column_shard, row_shard
from course_lib.tp.operators import (copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp,
                                     tp_size_and_rank)
from course_lib.tp.sequence import (gather_from_sequence, reduce_scatter_to_sequence,
                                    scatter_to_sequence, sync_sequence_parallel_grads)
from course_lib.tp.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["copy_to_tp", "reduce_from_tp", "split_to_tp", "gather_from_tp", "tp_size_and_rank",
           "ColumnParallelLinear", "RowParallelLinear", "column_shard", "row_shard",
           "ParallelMLP", "ParallelAttention", "ParallelBlock", "parallelize", "parallelize_block",
           "BLOCK_PLAN", "STYLES", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence",
           "sync_sequence_parallel_grads"]
