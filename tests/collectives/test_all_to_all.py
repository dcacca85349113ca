"""All-to-all on send/recv under torchrun (gloo): equal to torch's all_to_all_single at
world sizes 1-3 with even, uneven and zero-length splits, rows of any shape, on a
sub-group; all_to_all_v learns what it receives; the bytes per peer are the splits';
bad splits are refused before anything is sent."""
import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import comm, run
from course_lib.collectives import all_to_all, all_to_all_v

ship_by_value(__name__)


def splits_for(rank, world, case):
    """Rows rank ``rank`` sends each peer: even, uneven, or with empty pieces."""
    if case == "even":
        return [2] * world
    if case == "uneven":
        return [(rank + 2 * peer) % 3 + 1 for peer in range(world)]
    return [0 if (rank + peer) % 2 else rank + peer + 1 for peer in range(world)]


def compare_with_torch(case, row_shape, dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    send = splits_for(rank, world, case)
    recv = [splits_for(peer, world, case)[rank] for peer in range(world)]
    gen = torch.Generator(device="cpu").manual_seed(rank)
    x = (torch.randn(sum(send), *row_shape, generator=gen, device="cpu") * 100).to(dtype)
    ours = torch.full((sum(recv), *row_shape), -1).to(dtype)
    with comm.counting() as stats:
        all_to_all(ours, x, recv, send)
    theirs = torch.empty_like(ours)
    dist.all_to_all_single(theirs, x, recv, send)
    got_v, counts = all_to_all_v(x, send)
    return (torch.equal(ours, theirs), torch.equal(got_v, theirs), counts == recv,
            dict(stats.sent_to), send, x[0].numel() * x.element_size() if x.numel() else 0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_equal_to_torch_with_even_uneven_and_empty_pieces(world):
    for case, row_shape, dtype in (("even", (), torch.float32), ("uneven", (3, 2), torch.int64),
                                   ("empty", (5,), torch.float64)):
        for rank, (same, same_v, counts_ok, sent_to, send, row_bytes) in enumerate(
                run(compare_with_torch, case, row_shape, dtype, nproc=world)):
            assert same and same_v and counts_ok, (world, case, rank)
            # one message per peer with rows for it, carrying exactly those rows
            assert sent_to == {p: n * row_bytes for p, n in enumerate(send)
                               if n and p != rank}, (world, case, rank)


def on_a_subgroup():
    rank = dist.get_rank()
    group = dist.new_group([0, 2])
    out = None
    if rank in (0, 2):
        x = torch.arange(4.0) + 10 * rank
        out = torch.empty(4)
        all_to_all(out, x, group=group)  # group-local ranks 0 and 1
    dist.destroy_process_group(group)
    return out


def test_peers_are_group_local():
    outs = run(on_a_subgroup, nproc=3)
    assert outs[0].tolist() == [0.0, 1.0, 20.0, 21.0]
    assert outs[2].tolist() == [2.0, 3.0, 22.0, 23.0]
    assert outs[1] is None


def refused(kind):
    x = torch.zeros(5)
    if kind == "uneven default":
        all_to_all(torch.zeros(5), x)
    elif kind == "bad splits":
        all_to_all(torch.zeros(5), x, [2, 3], [4, 0])
    else:
        all_to_all(torch.zeros(5, dtype=torch.int64), x, [2, 3], [2, 3])


@pytest.mark.parametrize("kind,message", [
    ("uneven default", "5 rows, which 2 ranks cannot split evenly"),
    ("bad splits", r"splits \[4, 0\] must be 2 non-negative row counts adding up to its 5"),
    ("dtype", "must share dtype and row shape"),
])
def test_bad_splits_are_refused_before_any_message(kind, message):
    with pytest.raises(Exception, match=message):
        run(refused, kind, nproc=2)
