"""Door 4: the traffic a check grades is counted on the process group's methods, beneath
the student's code, on real gloo ranks; writing to course_lib.comm's counters, or taking
the wire's counters out, breaks the seal, and the check says so."""
import pytest
import torch
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib import comm
from course_lib.grading import checks, lab00, wire
from course_lib.runtime.launcher import run

ship_by_value(__name__)


def ring(x, how):
    """One ring step, sent ``how``; returns the report of wire.counting()."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    out = torch.empty_like(x)
    with wire.counting() as traffic:
        if how == "comm":
            comm.exchange(sends=[(x, right)], recvs=[(out, left)])
        elif how == "torch":
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, right),
                                            dist.P2POp(dist.irecv, out, left)])
            for work in works:
                work.wait()
        elif how == "backend":  # past ProcessGroup's own methods
            backend = dist.group.WORLD._get_backend(torch.device("cpu"))
            works = [backend.recv([out], left, 0), backend.send([x], right, 0)]
            for work in works:
                work.wait()
        elif how == "forged":  # nothing sent; comm's counters written as a ring's
            comm._active[-1].add_send(x.numel() * x.element_size(), right)
            comm._active[-1].add_recv(x.numel() * x.element_size(), left)
        elif how == "unsealed":  # the wire's wrapper taken out, then a message around it
            group_class = type(dist.group.WORLD)
            group_class.send = group_class.__dict__["send"].__closure__[1].cell_contents
            comm.exchange(sends=[(x, right)], recvs=[(out, left)])
    return traffic.as_dict()


@pytest.mark.parametrize("how", ["comm", "torch", "backend"])
def test_every_way_of_sending_is_counted_and_the_seal_holds(how):
    reports = run(ring, torch.ones(10), how, nproc=3, backend="gloo", timeout=60)
    for rank, report in enumerate(reports):
        assert wire.BROKEN not in report, report
        assert report["sent_to"] == {(rank + 1) % 3: 40}
        assert report["recv_from"] == {(rank - 1) % 3: 40}
        assert (report["sent_messages"], report["recv_messages"]) == (1, 1)


@pytest.mark.parametrize("how,why", [("forged", "counted traffic that never went out"),
                                     ("unsealed", "ProcessGroup.send was replaced")])
def test_a_forged_count_or_a_wrapper_taken_out_breaks_the_seal(how, why):
    reports = run(ring, torch.ones(10), how, nproc=2, backend="gloo", timeout=60)
    for report in reports:
        assert why in report[wire.BROKEN]
        assert report["sent_bytes"] == 0 if how == "forged" else True
    assert wire.broken([("x", reports[0])]) == reports[0][wire.BROKEN]
    assert wire.broken([{"sent_bytes": 0}, (1, "two")]) is None


def shift_that_forges_its_counts(x):
    """The right tensor (from the pattern) and comm's counters written as if one message
    each way went out: the sealed counts see none."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for stats in comm._active:
        stats.add_send(4, (rank + 1) % world)
        stats.add_recv(4, (rank - 1) % world)
    return torch.full((x.numel(),), float((rank - 1) % world)) + torch.arange(x.numel()) * 1e-3


@pytest.mark.notebook
def test_the_check_fails_a_forged_count_saying_the_seal_broke(sandbox):
    with pytest.raises(checks.CheckFailed, match="the instruments the check reads were written "
                                                 "to or taken out"):
        judged(sandbox, lab00.check_ring_shift, shift_that_forges_its_counts, world_sizes=(2,))


def ring_forward_with_comm_swapped(q, k, v, group):
    """Puts its own isend in course_lib.comm (past the check's log of posts and waits)."""
    comm.isend = lambda *args, **kwargs: None
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def test_lab07_s_log_of_posts_and_waits_is_sealed():
    from course_lib.grading.lab07.jobs import ring_forward_job

    reports = run(ring_forward_job, ring_forward_with_comm_swapped, False, nproc=2,
                  backend="gloo", timeout=60)
    assert all("course_lib.comm.isend was replaced" in traffic[wire.BROKEN]
               for _, traffic, _, _ in reports), reports[0][1]


def shift_by_all_gather(x):
    """Every rank's tensor by torch's all-gather, the left one kept, and one token
    message each way for the counts: a ring shift that is not one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x)
    comm.exchange(sends=[(x[:1].clone(), (rank + 1) % world)],
                  recvs=[(torch.empty(1), (rank - 1) % world)])
    return gathered[(rank - 1) % world]


def test_a_collective_is_seen_where_the_exercise_is_point_to_point_only():
    def job(fn, p2p_only):
        with wire.counting(p2p_only=p2p_only) as traffic:
            fn(torch.ones(3))
        return traffic.as_dict()

    strict = run(job, shift_by_all_gather, True, nproc=2, backend="gloo", timeout=60)
    assert all(report[wire.NOT_P2P] == "allgather" for report in strict)
    assert all(wire.NOT_P2P not in r for r in run(job, shift_by_all_gather, False, nproc=2,
                                                  backend="gloo", timeout=60))


@pytest.mark.notebook
def test_the_check_fails_a_shift_made_of_a_collective(sandbox):
    with pytest.raises(checks.CheckFailed, match="built from point-to-point messages only .* "
                                                 "collective\\(s\\) allgather"):
        judged(sandbox, lab00.check_ring_shift, shift_by_all_gather, world_sizes=(2,))
