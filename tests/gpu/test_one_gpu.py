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


def helper_thread_job():
    """The rank's helper thread computes on a stream of its own, and a handle's wait()
    orders the caller's stream after it (no host synchronisation needed)."""
    from course_lib.handle import Handle

    main_stream = torch.cuda.current_stream()
    x = torch.zeros(1 << 22)

    def slow_fill(t):
        for _ in range(20):  # long enough to be still running when the main thread reads
            t.add_(torch.ones_like(t))
        return torch.cuda.current_stream().stream_id

    handle = Handle.on_thread(None, slow_fill, x)
    handle.wait()
    helper_stream = handle._future.value()
    total = x.sum().item()  # on the main stream, ordered after the helper's by wait()
    return helper_stream != main_stream.stream_id, total


def test_the_helper_thread_has_its_own_stream_and_wait_orders_the_caller():
    (own_stream, total), = run(helper_thread_job, nproc=1, backend="nccl", timeout=120)
    assert own_stream and total == 20 * (1 << 22)


def test_one_process_drives_every_visible_gpu_through_nccl():
    """Lab 00's single-process form: one tensor per GPU, summed by a group call."""
    from course_lib.runtime.communicator import one_process_all_reduce

    n = torch.cuda.device_count()
    xs = [torch.full((1000,), float(d + 1), device=f"cuda:{d}") for d in range(n)]
    one_process_all_reduce(xs)
    for x in xs:
        assert torch.equal(x.cpu(), torch.full((1000,), n * (n + 1) / 2))
