"""Lab 04: pipeline parallelism, from naive model parallelism to 1F1B.

A model is cut into p stages, one per rank; the batch into m microbatches
that flow through them, activations forward and gradients backward. The
idle time at the start and end of a step, the bubble, is (p-1)/(m+p-1) of it
for GPipe and for 1F1B alike; 1F1B also bounds the activations stage s holds
by p-s microbatches instead of m.

- :mod:`~course_lib.pipeline.schedules`: schedules as data (``Action``, ``gpipe``,
  ``one_f_one_b``, ``interleaved_1f1b``, ``zb_h1``)
- :mod:`~course_lib.pipeline.validate`: ``validate`` (complete and ordered) and
  ``deadlock`` (the executor's message protocol played out), before anything runs
- :mod:`~course_lib.pipeline.simulate`: start and end of every action, the bubble,
  ``peak_in_flight``, the bubble formulas
- :mod:`~course_lib.pipeline.partition`: balanced contiguous stages (PipeDream's
  dynamic program) and the brute-force reference
- :mod:`~course_lib.pipeline.stage`: ``PipelineStage``, one microbatch's forward and
  backward, stages of the GPT and of MLPs with the full model's weights
- :mod:`~course_lib.pipeline.executor`: ``pipeline_step``, one step of a schedule on
  real ranks with counted point-to-point messages
- :mod:`~course_lib.pipeline.measure`: the bubble measured on a trace, stages that
  take a fixed time
- :mod:`~course_lib.pipeline.draw`: schedules and measured timelines drawn, a widget
- :mod:`~course_lib.pipeline.runs`: the jobs Lab 04 and the benchmark run on every rank
- :mod:`~course_lib.pipeline.async_1f1b`: PipeDream's asynchronous 1F1B on real ranks, an
  update after every backward, ``WeightStash``, and ``replay`` in one process
- :mod:`~course_lib.pipeline.versions`: the weight versions a run used, the bytes its stash
  held, and what 1F1B's order implies for them
"""
from course_lib.pipeline.async_1f1b import NoStash, WeightStash, async_1f1b, replay
from course_lib.pipeline.executor import microbatch_rows, pipeline_step
from course_lib.pipeline.measure import FixedTimeStage, measured_bubble, measured_timeline
from course_lib.pipeline.partition import bottleneck, even_split, partition, partition_brute_force
from course_lib.pipeline.schedules import (SCHEDULES, Action, gpipe, interleaved_1f1b,
                                           make_schedule, naive, one_f_one_b, zb_h1)
from course_lib.pipeline.simulate import (Simulation, bubble_fraction, peak_in_flight, simulate,
                                          weight_versions, zb_h1_bubble)
from course_lib.pipeline.validate import deadlock, validate
from course_lib.pipeline.stage import (GPTStage, PipelineStage, backward_step, forward_step,
                                       gpt_piece_costs, gpt_pieces, gpt_stage, mlp_stage,
                                       sequential_stage, uneven_mlp)

__all__ = ["Action", "SCHEDULES", "naive", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1",
           "make_schedule", "validate", "deadlock", "simulate", "Simulation", "peak_in_flight",
           "bubble_fraction", "zb_h1_bubble", "weight_versions", "partition",
           "partition_brute_force", "bottleneck",
           "even_split", "PipelineStage", "forward_step", "backward_step", "GPTStage",
           "gpt_stage", "gpt_pieces", "gpt_piece_costs", "uneven_mlp", "mlp_stage",
           "sequential_stage", "pipeline_step", "microbatch_rows", "FixedTimeStage",
           "measured_bubble", "measured_timeline", "async_1f1b", "WeightStash", "NoStash",
           "replay"]
