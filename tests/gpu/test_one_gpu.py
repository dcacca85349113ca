"""Device timing inside one process on one GPU (a one-rank NCCL job on
cuda:0): sync() waits for the device, and a span around enqueued kernels lasts
as long as they run, not as long as it took to enqueue them. Skipped, with the
reason, where no GPU is visible."""
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from conftest import needs_gpus, ship_by_value
from course_lib import run, sync, trace
from course_lib.runtime.backend import current_device
from course_lib.runtime.device import record_event, set_thread_device, wait_event

ship_by_value(__name__)

pytestmark = needs_gpus(1)


def one_gpu_job():
    x = torch.randn(4096, 4096)  # the launcher made cuda:0 the default device
    x = torch.tanh(x @ x * (1 / 64))  # loads cuBLAS outside the timed span
    sync()
    started = time.perf_counter()
    with trace.span("matmuls", "compute"):
        for _ in range(30):  # ~4 TFLOP: tens of ms on any GPU, ~1 ms to enqueue
            x = torch.tanh(x @ x * (1 / 64))
        enqueued = time.perf_counter() - started
    sync()
    finished = time.perf_counter() - started
    work = dist.all_reduce(torch.ones(1 << 20), async_op=True)
    trace.async_span("all_reduce", "comm", work).wait()
    ready = record_event()
    wait_event(ready)
    sync()  # now every event recorded so far has been passed
    with ThreadPoolExecutor(1, initializer=set_thread_device) as pool:
        thread = pool.submit(lambda: (torch.cuda.current_device(),
                                      str(torch.get_default_device()))).result()
    return (str(current_device()), enqueued, finished, thread, ready.query(),
            torch.isfinite(x).all().item())


def test_span_times_the_device_not_the_enqueue():
    res = run(one_gpu_job, nproc=1, backend="nccl", timeout=120)
    device, enqueued, finished, thread, ready_done, finite = res[0]
    assert device == "cuda:0" and thread == (0, "cuda:0") and ready_done and finite
    assert enqueued < finished  # the work itself outlasts its enqueue by far
    (matmuls,) = res.trace.select(name="matmuls")
    assert matmuls.duration > enqueued  # a host-clock span would last about `enqueued`
    (all_reduce,) = res.trace.select(name="all_reduce")
    assert all_reduce.end >= all_reduce.start >= matmuls.end
