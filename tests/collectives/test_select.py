"""collective_ops: torch's or the ring's collectives, equal values, counted alike (gloo, 3 ranks)."""
import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import comm, run
from course_lib.collectives import collective_ops

ship_by_value(__name__)


def every_collective(kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = collective_ops(kind)
    x = torch.arange(7.0) + rank  # 7 elements: not a multiple of 3
    with comm.counting() as stats:
        ops.all_reduce(x)
        gathered = torch.empty(5 * world)
        ops.all_gather(gathered, torch.full((5,), float(rank)), async_op=True).wait()
        scattered = torch.empty(4)
        ops.reduce_scatter(scattered, torch.arange(4.0 * world) * (rank + 1))
    return x, gathered, scattered, stats.as_dict()


@pytest.mark.parametrize("kind", ["torch", "ring"])
def test_values_and_counts_whichever_implementation(kind):
    world = 3
    scale = sum(r + 1 for r in range(world))
    outs = run(every_collective, kind, nproc=world, timeout=60)
    for rank, (got, gathered, scattered, stats) in enumerate(outs):
        torch.testing.assert_close(got, torch.arange(7.0) * world + sum(range(world)))
        torch.testing.assert_close(gathered, torch.arange(world).repeat_interleave(5).float())
        assert stats["collectives"] == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1}
        assert stats["collective_bytes"] == {"all_reduce": 7 * 4, "all_gather": 5 * world * 4,
                                             "reduce_scatter": 4 * world * 4}
        # the ring moves its bytes in counted messages; torch's moves none through comm
        assert (stats["sent_messages"] > 0) == (kind == "ring")
        torch.testing.assert_close(scattered, torch.arange(4.0 * world)[rank * 4:rank * 4 + 4] * scale)


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="torch"):
        collective_ops("nccl")
