"""Context parallelism (Lab 07): each rank holds a slice of the sequence.

- :mod:`~course_lib.cp.blockwise`: attention one key block at a time with its
  log-sum-exp, the merge of partial results (the online softmax), the positions each
  layout gives a rank, and the causal mask between two sets of positions.
"""
from course_lib.cp.blockwise import attention_with_lse, causal_mask, chunk_positions, merge

__all__ = ["attention_with_lse", "merge", "chunk_positions", "causal_mask"]
