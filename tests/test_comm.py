"""Counted point-to-point ops under real torchrun (gloo), world size 3."""
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import comm, run
from course_lib.comm import CommStats

ship_by_value(__name__)


def test_stats_accumulate_per_peer():
    stats = CommStats()
    stats.add_send(12, 1)
    stats.add_send(4, 1)
    stats.add_recv(8, 2)
    assert stats.as_dict() == {"sent_messages": 2, "sent_bytes": 16, "exchanges": 0,
                               "recv_messages": 1,
                               "recv_bytes": 8, "sent_to": {1: 16}, "recv_from": {2: 8},
                               "collectives": {}, "collective_bytes": {}}


def every_kind_of_message():
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    out = {}
    with comm.counting() as outer:
        # blocking ring, ordered so it cannot deadlock: rank 0 sends first
        a = torch.full((5,), float(rank), dtype=torch.float64)
        got_a = torch.empty_like(a)
        if rank == 0:
            comm.send(a, right)
            comm.recv(got_a, left)
        else:
            comm.recv(got_a, left)
            comm.send(a, right)
        with comm.counting() as inner:
            b = torch.full((7,), rank, dtype=torch.int32)
            got_b = torch.empty_like(b)
            works = [comm.irecv(got_b, left), comm.isend(b, right)]
            for w in works:
                w.wait()
            c = torch.full((3,), float(rank))
            got_c = torch.empty_like(c)
            comm.exchange(sends=[(c, left)], recvs=[(got_c, right)])
    out["values"] = (got_a, got_b, got_c)
    out["outer"], out["inner"] = outer.as_dict(), inner.as_dict()
    return out


def test_messages_arrive_and_are_counted():
    outs = run(every_kind_of_message, nproc=3)
    for rank, o in enumerate(outs):
        right, left = (rank + 1) % 3, (rank - 1) % 3
        got_a, got_b, got_c = o["values"]
        assert torch.equal(got_a, torch.full((5,), float(left), dtype=torch.float64))
        assert torch.equal(got_b, torch.full((7,), left, dtype=torch.int32))
        assert torch.equal(got_c, torch.full((3,), float(right)))
        # one exchange: the isend/irecv pair are not one (each posts alone)
        assert o["inner"] == {"sent_messages": 2, "sent_bytes": 28 + 12, "exchanges": 1,
                              "recv_messages": 2,
                              "recv_bytes": 28 + 12, "sent_to": {right: 28, left: 12},
                              "recv_from": {left: 28, right: 12},
                              "collectives": {}, "collective_bytes": {}}
        assert o["outer"]["sent_messages"] == 3 and o["outer"]["sent_bytes"] == 40 + 40
        assert o["outer"]["recv_from"] == {left: 40 + 28, right: 12}


def traced_exchange():
    x = torch.ones(256)
    y = torch.empty(256)
    rank, world = dist.get_rank(), dist.get_world_size()
    comm.exchange(sends=[(x, (rank + 1) % world)], recvs=[(y, (rank - 1) % world)])
    comm.send(x, 1) if rank == 0 else comm.recv(y, 0) if rank == 1 else None


def test_messages_leave_comm_spans_with_bytes_and_peer():
    tr = run(traced_exchange, nproc=3).trace
    for rank in range(3):
        (ex,) = [s for s in tr.select(rank=rank, cat="comm") if s.name.startswith("exchange")]
        assert ex.bytes == 1024 and ex.peer == (rank + 1) % 3 and ex.end >= ex.start
    (send,) = tr.select(rank=0, name="send→1")
    (recv,) = tr.select(rank=1, name="recv←0")
    assert send.bytes == recv.bytes == 1024 and recv.peer == 0


def bad_peers():
    errors = []
    for call in (lambda: comm.send(torch.ones(1), dist.get_rank()),
                 lambda: comm.recv(torch.ones(1), 5),
                 lambda: comm.exchange(sends=[(torch.ones(1), -1)])):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_bad_peers_raise_before_sending():
    errors = run(bad_peers, nproc=2)[0]
    assert len(errors) == 3
    assert "itself" in errors[0] and "[0, 2)" in errors[1] and "[0, 2)" in errors[2]


def test_empty_exchange_is_a_no_op():
    assert run(lambda: comm.exchange_async().is_completed(), nproc=2) == [True, True]


def on_sub_groups():
    """Global ranks {0, 2} and {1, 3} form two groups; in each, group rank 0
    sends to group rank 1 (global 0 -> 2 and 1 -> 3)."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[rank % 2]
    me = dist.get_rank(mine)
    x = torch.full((4,), float(rank))
    with comm.counting() as stats:
        if me == 0:
            comm.send(x, 1, group=mine)
            h = comm.isend(x * 10, 1, group=mine)
            h.wait()
        else:
            comm.recv(x, 0, group=mine)
            y = torch.empty(4)
            comm.irecv(y, 0, group=mine).wait()
            x = torch.stack([x, y])
    wrong_member = None
    try:  # a peer named by its global rank (2) is not a rank of a 2-member group
        comm.send(x, 2, group=mine)
    except ValueError as exc:
        wrong_member = str(exc)
    return me, x, stats.as_dict(), wrong_member


def test_peers_are_group_local_and_counted_as_such():
    outs = run(on_sub_groups, nproc=4, timeout=120)
    for rank, (me, x, stats, wrong) in enumerate(outs):
        assert me == rank // 2
        source = rank % 2  # global rank of group rank 0
        if me == 1:
            assert torch.equal(x, torch.stack([torch.full((4,), float(source)),
                                               torch.full((4,), 10.0 * source)]))
            assert stats["recv_from"] == {0: 32} and stats["sent_messages"] == 0
        else:
            assert stats["sent_to"] == {1: 32} and stats["recv_messages"] == 0
        assert "group-local rank in [0, 2)" in wrong


def two_tagged_streams():
    """Rank 0 sends an 'activation' (tag 1) then a 'gradient' (tag 2); rank 1
    posts the gradient's receive first. gloo matches by (peer, tag)."""
    rank = dist.get_rank()
    if rank == 0:
        first = comm.isend(torch.full((3,), 1.0), 1, tag=1)
        second = comm.isend(torch.full((5,), 2.0), 1, tag=2)
        first.wait()
        second.wait()
        return None
    grad, act = torch.empty(5), torch.empty(3)
    h_grad = comm.irecv(grad, 0, tag=2)
    h_act = comm.irecv(act, 0, tag=1)
    h_act.wait()
    h_grad.wait()
    return act, grad


def test_tags_keep_two_streams_between_one_pair_apart():
    # gloo's tags (NCCL has none: under its rules a tag is refused, nccl_rules rule 1)
    act, grad = run(two_tagged_streams, nproc=2, backend="gloo", timeout=60, nccl_rules=False)[1]
    assert torch.equal(act, torch.full((3,), 1.0)) and torch.equal(grad, torch.full((5,), 2.0))


def handles_everywhere():
    from course_lib.handle import Handle

    rank = dist.get_rank()
    peer = 1 - rank
    x, y = torch.full((8,), float(rank)), torch.empty(8)
    handles = [comm.irecv(y, peer), comm.isend(x, peer)]
    futures = [h.get_future() for h in handles]  # gloo p2p: completed by a waiter thread
    torch.futures.wait_all(futures)
    kinds = {type(h).__name__ for h in handles}
    done = [h.is_completed() for h in handles]
    step = comm.exchange_async(sends=[(x, peer)], recvs=[(y, peer)])
    step.wait()
    return kinds, done, isinstance(step, Handle), y[0].item()


def test_every_async_call_returns_one_handle_type():
    for rank, (kinds, done, is_handle, got) in enumerate(run(handles_everywhere, nproc=2)):
        assert kinds == {"Handle"} and done == [True, True] and is_handle
        assert got == float(1 - rank)


def test_nested_counting_blocks_with_equal_counts_each_remove_their_own():
    with comm.counting() as outer:
        with comm.counting() as inner:  # both empty: equal as dataclasses
            pass
        comm._count_send(torch.ones(2), 1)
    assert outer.sent_messages == 1 and inner.sent_messages == 0
    assert comm._active == []
