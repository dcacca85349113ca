"""What bucketed DDP would hide on a GPU node: the bucket sweep projected with the
alpha-beta model (Lab 02). Projected, not measured.

Backward produces the gradients at an even rate, last layer first; a bucket of
``cap`` bytes is ready once backward has produced its last byte, and its ring
all-reduce (Lab 01: 2(K-1)(alpha + S/(K B)) for S bytes) runs as soon as the bucket
is ready and the previous one is done (one communication stream). What outlives
backward is the exposed communication:

    t_ready(i) = backward x (bytes up to the end of bucket i) / P
    start(i) = max(t_ready(i), end(i-1)),   end(i) = start(i) + T_ring(S_i)
    exposed = end(last) - backward

Small buckets pay a latency each (2(K-1) alpha); one bucket holding everything
starts only when backward ends, so nothing overlaps; in between the exposed time
shrinks to about one bucket's all-reduce::

    projected_bucket_sweep(4 * 124e6, 4.1e-3, 8.2e-3, [1, 25, 500], 8, 3e-6, 450e9)
"""
from __future__ import annotations

import math

from course_lib.collectives.cost_model import ring_all_reduce_time

MB = 2**20  # torch's bucket_cap_mb is in MiB


def exposed_communication(param_bytes, backward_s, cap_bytes, k, alpha, bandwidth):
    """Seconds of all-reduce left when backward ends, buckets of ``cap_bytes``."""
    n_buckets = max(1, math.ceil(param_bytes / cap_bytes))
    end, done = 0.0, 0.0
    for i in range(n_buckets):
        size = min(cap_bytes, param_bytes - done)
        done += size
        ready = backward_s * done / param_bytes
        end = max(ready, end) + ring_all_reduce_time(size, k, alpha, bandwidth)
    return max(0.0, end - backward_s)


def projected_bucket_sweep(param_bytes, forward_s, backward_s, caps_mb, k, alpha, bandwidth):
    """{cap in MiB: seconds per step} = forward + backward + exposed all-reduce, and
    under "after backward" the step with one all-reduce of everything once backward
    is done (no overlap)."""
    out = {cap: forward_s + backward_s + exposed_communication(
        param_bytes, backward_s, cap * MB, k, alpha, bandwidth) for cap in caps_mb}
    out["after backward"] = forward_s + backward_s + ring_all_reduce_time(
        param_bytes, k, alpha, bandwidth)
    return out
