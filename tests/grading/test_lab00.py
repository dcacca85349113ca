"""What Lab 00's second deadlock says about mismatched collectives, checked on
gloo: they hang (no error) until the launcher stops them, with each rank's stack
in its own collective; TORCH_DISTRIBUTED_DEBUG=DETAIL turns the hang into an
error naming both operations."""
import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import LaunchError, LaunchTimeout, run

ship_by_value(__name__)


def mismatched_collectives():
    x = torch.full((1000,), float(dist.get_rank() + 1))
    if dist.get_rank() == 0:
        dist.all_reduce(x)
    else:
        dist.broadcast(x, src=0)
    return x.sum().item()


def ready():
    return dist.get_rank()


@pytest.mark.slow
def test_mismatched_collectives_hang_on_gloo_and_the_stacks_show_both_calls():
    # start the ranks first: on a busy machine a cold start alone can outlast the
    # short timeout, and then no rank has reached a collective to show in its stack
    assert run(ready, nproc=2, backend="gloo", timeout=120) == [0, 1]
    with pytest.raises(LaunchTimeout) as info:
        run(mismatched_collectives, nproc=2, backend="gloo", timeout=8)
    stacks = info.value.stacks
    assert sorted(stacks) == [0, 1]
    assert "in all_reduce" in stacks[0] and "in broadcast" not in stacks[0]
    assert "in broadcast" in stacks[1] and "in all_reduce" not in stacks[1]


@pytest.mark.slow
def test_distributed_debug_detail_reports_the_mismatch(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    with pytest.raises(LaunchError) as info:
        run(mismatched_collectives, nproc=2, backend="gloo", timeout=60, fresh=True)
    assert not isinstance(info.value, LaunchTimeout)
    message = info.value.errors[0]["message"]
    assert "Detected mismatch between collectives" in message
    assert "OpType=ALLREDUCE" in message and "OpType=BROADCAST" in message
