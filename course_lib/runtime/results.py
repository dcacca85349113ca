"""What a call hands back to the notebook: one value per rank, and the merged trace."""
from __future__ import annotations

import cloudpickle


class Results(list):
    """Per-rank return values (``results[r]`` came from rank r), plus the job's
    merged :class:`~course_lib.trace.Trace` as ``.trace``, its ``.backend``, its
    rendezvous ``.port``, ``.wall_time`` in seconds (launch to exit, as the
    notebook saw it) and ``.restarts``, how many times torchrun restarted the ranks
    before they returned (0 unless the call gave ``max_restarts``)."""

    restarts = 0
    trace = None
    port = None
    backend = None
    wall_time = None


def read_results(job_dir, nproc, number):
    """The ranks' values of call ``number``, from the job folder's ``result{rank}-{number}.pkl``
    (the value on CPU and the rank's trace export)."""
    results, exports = Results(), []
    for rank in range(nproc):
        value, trace_export = cloudpickle.loads(
            (job_dir / f"result{rank}-{number}.pkl").read_bytes())
        results.append(value)
        if trace_export is not None:
            exports.append(trace_export)
    if exports:
        from course_lib.trace import Trace  # the trace layer sits above the runtime

        results.trace = Trace.from_exports(exports)
    return results
