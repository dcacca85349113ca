"""gloo under NCCL's rules: each rule refuses what NCCL would, and names the rule; what
NCCL accepts still runs."""
import threading

import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import LaunchError, comm, run, trace
from course_lib.collectives import ring
from course_lib.runtime.nccl_rules import NcclRuleError, check_destroy_order

ship_by_value(__name__)


def run_under_rules(fn, *args, nproc=2, timeout=60):
    return run(fn, *args, nproc=nproc, nccl_rules=True, timeout=timeout)


def tags_matter():
    """Two messages told apart by their tags only, received in the other order."""
    if dist.get_rank() == 0:
        first = comm.isend(torch.full((3,), 1.0), 1, tag=1)
        second = comm.isend(torch.full((3,), 2.0), 1, tag=2)
        first.wait()
        second.wait()
        return None
    two, one = torch.empty(3), torch.empty(3)
    comm.recv(two, 0, tag=2)
    comm.recv(one, 0, tag=1)
    return one.tolist(), two.tolist()


def tagged_call(how):
    """One tagged message, posted each way the rule must see (the peer waits for nothing)."""
    x, peer = torch.ones(2), 1 - dist.get_rank()
    try:
        if how == "keyword":
            dist.isend(x, peer, tag=7)
        elif how == "position":
            dist.irecv(x, peer, None, 7)
        else:
            dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer, tag=7)])
    except NcclRuleError as exc:
        return str(exc)
    return None


@pytest.mark.slow  # several jobs under the rules: `make test-slow`
def test_a_tag_is_refused_at_once_naming_the_rule_and_the_call():
    # gloo keeps two tagged streams apart; NCCL would match them by posting order and
    # swap them without a word, so under its rules the tag itself is refused
    assert run(tags_matter, nproc=2, nccl_rules=False)[1] == ([1.0] * 3, [2.0] * 3)
    with pytest.raises(LaunchError, match=r"NcclRuleError: NCCL rule \(no tags\): i?(send|recv)"
                                          r"\(\) was given tag=[12]\. NCCL matches messages by "
                                          r"posting order, it has no tags"):
        run_under_rules(tags_matter)
    said = run_under_rules(tagged_call, "keyword") + run_under_rules(tagged_call, "position")
    assert all("(no tags)" in s for s in said)
    assert "isend() was given tag=7" in said[0] and "irecv() was given tag=7" in said[2]
    batch = run_under_rules(tagged_call, "batch")
    assert all("batch_isend_irecv() (isend of a P2POp) was given tag=7" in s for s in batch)


def two_threads_at_once():
    peer = 1 - dist.get_rank()
    out = torch.empty(1000)
    pending = comm.irecv(out, peer)  # in flight on the main thread
    failure = []

    def other():
        try:
            dist.all_reduce(torch.ones(1))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            failure.append(exc)

    helper = threading.Thread(target=other, name="helper")
    helper.start()
    helper.join()
    dist.barrier()  # nothing is sent before both helpers have tried
    comm.send(torch.ones(1000), peer)
    pending.wait()
    return repr(failure[0]) if failure else None


def test_two_threads_issuing_at_once_are_refused():
    refused = run_under_rules(two_threads_at_once)
    assert all("one issuing thread at a time" in r and "helper issues all_reduce()" in r and
               "has irecv() in flight" in r for r in refused), refused


def future_of_a_coalesced_message():
    peer = 1 - dist.get_rank()
    ops = [dist.P2POp(dist.isend, torch.ones(2), peer), dist.P2POp(dist.irecv, torch.empty(2), peer)]
    works = dist.batch_isend_irecv(ops)
    try:
        works[0].get_future()
        refused = None
    except NcclRuleError as exc:
        refused = str(exc)
    for work in works:
        work.wait()
    return refused


def test_a_coalesced_message_has_no_future():
    assert set(run_under_rules(future_of_a_coalesced_message)) == {
        "NCCL rule (coalesced works): a work of batch_isend_irecv has no future on NCCL; "
        "wait on the work itself"}


def traced_exchanges():
    """What every from-scratch collective does: traced exchanges, a ring, async too."""
    r, w = dist.get_rank(), dist.get_world_size()
    out = torch.empty(5)
    comm.exchange(sends=[(torch.full((5,), float(r)), (r + 1) % w)], recvs=[(out, (r - 1) % w)])
    x = torch.arange(7.0) + r
    ring.all_reduce(x, async_op=True).wait()
    return out.tolist(), x.tolist(), len(trace.get_tracer()._spans)


def test_what_nccl_accepts_runs_and_is_traced():
    for rank, (out, x, spans) in enumerate(run_under_rules(traced_exchanges, nproc=3)):
        assert out == [float((rank - 1) % 3)] * 5 and x == [3.0 * v + 3 for v in range(7)]
        assert spans >= 1 + 4  # the exchange and the ring's 2(n-1) steps


def destroy_in_rank_order():
    groups = [dist.new_group([0, 1]) for _ in range(3)]
    for group in (groups if dist.get_rank() == 0 else groups[::-1]):
        dist.destroy_process_group(group)


def test_groups_destroyed_in_different_orders_are_refused():
    with pytest.raises(LaunchError, match=r"NCCL rule \(teardown order\): rank 0 destroyed "
                                          r"group \d+, group \d+, group \d+ in that order"):
        run_under_rules(destroy_in_rank_order)
    assert check_destroy_order({0: ["a", "b"], 1: ["a", "c", "b"], 2: ["c"]}) is None
    with pytest.raises(NcclRuleError, match="rank 0 destroyed a, b in that order, rank 1 b, a"):
        check_destroy_order({0: ["a", "b"], 1: ["b", "a"]})


def collectives_in_different_orders():
    x = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(x)
        dist.broadcast(x, 0)
    else:
        dist.broadcast(x, 0)
        dist.all_reduce(x)


def test_collectives_in_different_orders_are_named():
    with pytest.raises(LaunchError, match=r"NCCL rule \(the same collectives in the same "
                                          r"order\): the collective number 1 on the world is "
                                          r"(all_reduce|broadcast)\(\) of a \[4\] float32 "
                                          r"tensor on rank \d but (all_reduce|broadcast)"):
        run_under_rules(collectives_in_different_orders, timeout=60)


def shapes_differ_and_messages_are_uneven():
    """Rank 0 sends more messages than the others (gloo's DETAIL check counted those),
    then the ranks all-reduce tensors of different lengths."""
    rank = dist.get_rank()
    if rank == 0:
        comm.send(torch.ones(2), 1)
    elif rank == 1:
        comm.recv(torch.empty(2), 0)
    dist.all_reduce(torch.ones(3))  # same shapes, uneven messages before: accepted
    dist.all_reduce(torch.ones(3 + rank))


def test_collectives_of_different_shapes_are_named_and_uneven_messages_are_not():
    with pytest.raises(LaunchError, match=r"collective number 2 on the world is all_reduce\(\) "
                                          r"of a \[\d\] float32 tensor on rank \d but "
                                          r"all_reduce\(\) of a \[\d\] float32 tensor"):
        run_under_rules(shapes_differ_and_messages_are_uneven, nproc=3, timeout=60)


def one_rank_skips_the_barrier():
    if dist.get_rank() == 0:
        dist.barrier()


@pytest.mark.slow  # a hang waited out: `make test-slow`
def test_a_rank_missing_from_a_collective_hangs_and_is_diagnosed():
    run_under_rules(int)  # start the job first: the short timeout is for the hang alone
    with pytest.raises(LaunchError) as info:
        run_under_rules(one_rank_skips_the_barrier, timeout=8)
    assert info.value.diagnosis.kind == "missing-from-collective"
    assert "rank 0 waits in barrier()" in str(info.value)


def leaves_six_groups():
    return len([dist.new_group([0, 1, 2]) for _ in range(6)])


def test_groups_a_call_leaves_are_destroyed_in_one_order_on_every_rank():
    """The warm ranks destroy what a call left (issue 18, defect 7: in a set's order,
    which differs between interpreters, the rule refused it)."""
    for _ in range(2):
        assert run_under_rules(leaves_six_groups, nproc=3) == [6, 6, 6]


def blocking_behind_asynchronous():
    a, b = torch.ones(200_000), torch.ones(10)
    pending = ring.all_reduce(a, async_op=True)  # on the rank's helper thread
    ring.all_reduce(b)  # blocking: must take its turn behind the ring in flight
    pending.wait()
    return a[-1].item(), b[0].item()


def test_a_blocking_collective_waits_its_turn_behind_an_asynchronous_one():
    """Issue 18, defect 9: run inline, the blocking ring's messages were issued from the
    main thread while the helper thread's were in flight, and the rule refused them."""
    assert run_under_rules(blocking_behind_asynchronous, nproc=3) == [(3.0, 3.0)] * 3
