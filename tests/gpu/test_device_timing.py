"""Device-true timing on NCCL: clocks bracketed by sync(), spans read from CUDA
events, helper threads on the rank's GPU, hand-offs ordered by events.

No test here compares a time with a fixed number: each compares two timings
taken on the same devices in one job (an ordering), or checks that a span has
a positive device duration. Skipped, with the reason, where fewer than 2 GPUs
are visible.
"""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import needs_gpus, ship_by_value
from course_lib import comm, run, sync, trace
from course_lib.collectives import p2p
from course_lib.ddp import DDP
from course_lib.models import deep_mlp
from course_lib.runtime.backend import current_device
from course_lib.runtime.device import record_event, run_after, set_thread_device
from course_lib.trace.metrics import intersect, total, union

ship_by_value(__name__)

pytestmark = needs_gpus(2)
TIMEOUT = 120
KB, MB = 1 << 10, 1 << 20


def test_ping_pong_time_grows_with_message_size():
    """Without sync() rank 0 would time the enqueue of a send, about equal for
    1 KB and 64 MB; timed on the device, 64 MB takes longer."""
    out = run(p2p.measure_ping_pong, p2p.ping_pong, [KB, 64 * MB], 5, 2, nproc=2,
              backend="nccl", timeout=TIMEOUT)
    one_way = out[0]
    assert list(one_way) == [KB, 64 * MB] and out[1] == {}
    assert 0 < one_way[KB] < one_way[64 * MB]


def comm_spans_job():
    rank = dist.get_rank()
    peer = 1 - rank
    for nbytes in (4 * KB, 64 * MB):
        sync()  # each operation starts on an idle device: its span is its own
        x = torch.ones(nbytes // 4)
        trace.async_span(f"all_reduce {nbytes}", "comm", dist.all_reduce(x, async_op=True)).wait()
    sync()
    x = torch.ones(16 * MB // 4)
    if rank == 0:
        comm.send(x, peer)
    else:
        comm.recv(x, peer)
    sync()
    comm.exchange(sends=[(x, peer)], recvs=[(torch.empty_like(x), peer)])
    sync()
    return x[0].item()


def test_comm_spans_have_device_duration():
    res = run(comm_spans_job, nproc=2, backend="nccl", timeout=TIMEOUT)
    assert list(res) == [1.0, 1.0]
    for rank in (0, 1):
        spans = {s.name: s for s in res.trace.select(rank=rank, cat="comm")}
        p2p_name = "send→1" if rank == 0 else "recv←0"
        assert {f"all_reduce {4 * KB}", f"all_reduce {64 * MB}", p2p_name} <= set(spans)
        assert any(name.startswith("exchange") for name in spans)
        assert all(s.duration > 0 for s in spans.values()), spans
        # the same collective on 16384x the bytes, on the same GPUs: it lasts longer
        assert spans[f"all_reduce {64 * MB}"].duration > spans[f"all_reduce {4 * KB}"].duration


def ddp_overlap_job(bucket_mb):
    """One traced DDP step of a deep MLP. The gradient computation is a span
    between two device stamps: before backward, and in the hook of whichever
    parameter's gradient is accumulated last."""
    device = current_device()
    model = DDP(deep_mlp(2048, 8, inputs=2048, outputs=2048).to(device), bucket_cap_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 2048), torch.zeros(256, 2048)

    def step():
        opt.zero_grad(set_to_none=False)
        F.mse_loss(model(x), y).backward()
        opt.step()

    with trace.paused():  # warm-up: buckets become gradient views, kernels are loaded
        step()
        step()
    sync()
    dist.barrier()
    tracer = trace.get_tracer()
    last = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: last.update(end=tracer.stamp()))
             for p in model.parameters()]
    loss = F.mse_loss(model(x), y)
    start = tracer.stamp()
    loss.backward()
    tracer.record("gradients", "compute", start, last["end"])
    for h in hooks:
        h.remove()
    return len(model.buckets)


def test_ddp_overlap_measured_from_device_events():
    """A bucket's all-reduce starts on the device once its gradients are in, while
    backward computes the earlier layers' gradients on the same device: the comm
    spans intersect the gradient span. Each bucket's span is its device time."""
    res = run(ddp_overlap_job, 4.0, nproc=2, backend="nccl", timeout=TIMEOUT)
    for rank, buckets in enumerate(res):
        assert buckets > 2
        comm_spans = [s for s in res.trace.select(rank=rank, cat="comm")
                      if s.name.startswith("bucket")]
        (grads,) = res.trace.select(rank=rank, name="gradients")
        assert len(comm_spans) == buckets and all(s.duration > 0 for s in comm_spans)
        comm_time = union([(s.start, s.end) for s in comm_spans])
        overlapped = total(intersect(comm_time, [(grads.start, grads.end)]))
        assert overlapped / total(comm_time) > 0


def helper_thread_job():
    """A helper thread computes on the rank's GPU, and reads a tensor filled on
    the main thread's stream only after the fill (ordered by an event, not by
    the host)."""
    rank = dist.get_rank()
    x = torch.zeros(1 << 24)
    for _ in range(20):
        x.add_(1)  # enqueued; the host does not wait for them
    filled = record_event()

    def consume():
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            seen = run_after(filled, lambda: torch.stack([x.min(), x.max()]))
        side.synchronize()
        return (torch.cuda.current_device(), str(torch.get_default_device()),
                str(torch.empty(1).device), seen.tolist())

    with ThreadPoolExecutor(1, initializer=set_thread_device) as pool:
        return rank, pool.submit(consume).result()


def test_helper_threads_use_the_rank_gpu_and_wait_for_the_fill():
    for rank, (index, default, allocated, seen) in run(helper_thread_job, nproc=2,
                                                       backend="nccl", timeout=TIMEOUT):
        assert (index, default, allocated) == (rank, f"cuda:{rank}", f"cuda:{rank}")
        assert seen == [20.0, 20.0]
