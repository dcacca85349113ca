"""Which rank a failed job names first: the cause, ranked (failures.cause_rank), not
merely the earliest record. Pure logic on records, then real gloo jobs where a peer's
death follows the cause."""
import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import LaunchError, comm, run
from course_lib.runtime.failures import _silent_death, cause_rank, failure

ship_by_value(__name__)


def record(rank, type_, message, time_):
    return {"rank": rank, "type": type_, "message": message, "time": time_, "traceback": ""}


RULE = record(0, "NcclRuleError", "one issuing thread at a time: ...", 12.5)
STUDENT = record(1, "ValueError", "shapes differ", 12.7)
PEER_GONE = record(2, "RuntimeError", "[pair.cc:534] Connection closed by peer [127.0.0.1]:4242",
                   12.1)
STORE_GONE = record(3, "DistNetworkError", "failed to recv, got 0 bytes", 12.2)
ABORTED = _silent_death(4, signal.SIGABRT)


def test_a_ranks_own_exception_outranks_a_silent_death_and_a_broken_connection():
    assert [cause_rank(e) for e in (RULE, STUDENT, ABORTED, PEER_GONE, STORE_GONE)] == [
        0, 0, 1, 2, 2]
    first = failure([PEER_GONE, ABORTED, STUDENT, STORE_GONE, RULE], []).errors
    assert [e["rank"] for e in first] == [0, 1, 4, 2, 3]  # by rank of cause, then by time


def test_a_silent_death_outranks_the_broken_connections_it_caused():
    error = failure([PEER_GONE, STORE_GONE, _silent_death(4, signal.SIGKILL)], [])
    assert str(error).startswith("rank 4 failed with SIGKILL")
    assert "(ranks [2, 3] failed as well, probably as a consequence)" in str(error)


def rule_then_peer_aborts():
    """Rank 0 breaks NCCL's one-issuing-thread rule; rank 1, left waiting for it, aborts
    without a word when the connection breaks (as gloo's C++ does at times)."""
    if dist.get_rank() == 1:
        try:
            comm.recv(torch.empty(4), 0)  # never sent: rank 0 fails first
        finally:
            os.abort()
    pending = []
    helper = threading.Thread(target=lambda: pending.append(comm.irecv(torch.empty(4), 1)))
    helper.start()
    helper.join()
    dist.all_reduce(torch.ones(1))  # the main thread issues while the helper's is in flight


@pytest.mark.slow  # the two-thread case, repeated: `make test-slow`
def test_the_rule_is_named_before_the_abort_that_followed_it():
    """Issue 33: one run in about a dozen named the aborting peer (no record, sorted first)
    instead of the rule. Here the peer aborts every time, so every run is that case (twenty
    runs, the issue's bar, passed; three keep CI within its time)."""
    for _ in range(3):
        with pytest.raises(LaunchError) as caught:
            run(rule_then_peer_aborts, nproc=2, nccl_rules=True, timeout=30)
        assert str(caught.value).startswith("rank 0 failed with NcclRuleError"), caught.value
        assert "one issuing thread at a time" in str(caught.value)
