"""Context parallelism (Lab 07): each rank holds a slice of the sequence.

- :mod:`~course_lib.cp.blockwise`: attention one key block at a time with its
  log-sum-exp, the merge of partial results (the online softmax), the positions each
  layout gives a rank, and the causal mask between two sets of positions;
- :mod:`~course_lib.cp.ring_attention`: ring attention, forward and backward;
- :mod:`~course_lib.cp.ulysses`: Ulysses attention, two all-to-alls around attention on
  whole heads instead of a ring;
- :mod:`~course_lib.cp.model`: the course GPT with its attention context parallel.
"""
from course_lib.cp.blockwise import attention_with_lse, causal_mask, chunk_positions, merge
from course_lib.cp.model import (ContextParallelAttention, context_parallel, cp_logits,
                                 cp_loss, sum_gradients)
from course_lib.cp.ring_attention import ring_attention
from course_lib.cp.ulysses import ulysses_attention

__all__ = ["attention_with_lse", "merge", "chunk_positions", "causal_mask", "ring_attention",
           "ulysses_attention", "ContextParallelAttention", "context_parallel", "cp_logits", "cp_loss",
           "sum_gradients"]
