"""Expert parallelism (Lab 07).

- :mod:`~course_lib.ep.moe`: the mixture-of-experts layer in one process (router,
  top-k gates, capacity per expert, Switch's load-balancing loss), the reference;
- :mod:`~course_lib.ep.expert_parallel`: its experts split over a group, tokens
  dispatched and combined with differentiable all-to-alls.
"""
from course_lib.ep.expert_parallel import AllToAll, ExpertParallelMoE
from course_lib.ep.moe import MoE, balance_loss, capacity, kept_assignments

__all__ = ["MoE", "balance_loss", "capacity", "kept_assignments", "ExpertParallelMoE",
           "AllToAll"]
