"""The star all-reduce and the adaptive dispatch under torchrun (gloo), K = 3: equal to
torch's all-reduce on sizes that do not divide, and the traffic of the algorithm chosen."""
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import comm, run
from course_lib.collectives import adaptive_all_reduce, star_all_reduce

ship_by_value(__name__)


def star_and_adaptive():
    rank = dist.get_rank()
    out = []
    for numel, op in ((1, dist.ReduceOp.SUM), (13, dist.ReduceOp.MAX), (1001, dist.ReduceOp.AVG)):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        want = x.clone()
        dist.all_reduce(want, op=op)
        with comm.counting() as stats:
            star_all_reduce(x, op)
        out.append(("star", torch.allclose(x, want, atol=1e-6), stats.as_dict()))
    for numel in (7, 1001):  # 28 and 4004 bytes around N* = 750 at alpha = 1 ms, B = 1 MB/s
        x = torch.full((numel,), float(rank))
        with comm.counting() as stats:
            chosen = adaptive_all_reduce(x, alpha=1e-3, bandwidth=1e6)
        out.append((chosen, bool((x == 3.0).all()), stats.as_dict()))
    return out


def test_the_star_and_the_dispatch_reduce_correctly_with_their_own_traffic():
    for rank, results in enumerate(run(star_and_adaptive, nproc=3)):
        assert all(ok for _, ok, _ in results)
        for name, _, stats in results[:3]:
            assert stats["exchanges"] == 2
            assert stats["sent_messages"] == (2 if rank == 0 else 1)
        (small, _, s_stats), (large, _, l_stats) = results[3:]
        assert (small, large) == ("star", "ring")
        assert s_stats["exchanges"] == 2 and l_stats["sent_messages"] == 4
        assert set(l_stats["sent_to"]) == {(rank + 1) % 3}
