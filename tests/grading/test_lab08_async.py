"""Exercise 8.6's check: the solution passes (also as the gradebook's judge decides), the
stub and each plausible wrong answer fail with their own reason; the library's saver
passes the comparison and is refused by the judge."""
import copy
import re
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib.checkpoint.boxes import map_state
from course_lib.checkpoint.files import data_file
from course_lib.checkpoint.save import commit, layout, refuse_committed, write_data
from course_lib.grading import checks
from course_lib.grading.lab08.background import check_async_save

ship_by_value(__name__)


class Saver:
    """The exercise's saver, each of its decisions a switch (all on: the solution)."""

    def __init__(self, timeout=60.0, copies=True, threaded=True, gather_in_thread=False,
                 waits_first=True, waits_for_files=True, keeps_error=True, deadline=True,
                 names_missing=True, returns=True, refuses=True, removes_stale=True,
                 forgets=True, agrees_in_wait=False):
        self.timeout, self.thread, self.error = timeout, None, None
        self.copies, self.threaded, self.gather_in_thread = copies, threaded, gather_in_thread
        self.waits_first, self.waits_for_files, self.keeps_error = (waits_first,
                                                                    waits_for_files, keeps_error)
        self.deadline, self.names_missing, self.returns = deadline, names_missing, returns
        self.refuses, self.removes_stale, self.forgets = refuses, removes_stale, forgets
        self.agrees_in_wait = agrees_in_wait

    def save(self, state, path, group=None):
        if self.waits_first:
            self.wait()
        path, rank, world = Path(path), dist.get_rank(group), dist.get_world_size(group)
        if self.refuses:
            refuse_committed(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.removes_stale:
            (path / data_file(rank)).unlink(missing_ok=True)
        if self.copies:
            state = map_state(state, lambda t: t.detach().to("cpu", copy=True), copy.deepcopy)
        tensors, described, values = layout(state, path, rank)
        everyone = [None] * world

        def gather():
            dist.all_gather_object(everyone, described, group=group)

        if not self.gather_in_thread:
            gather()

        def write():
            try:
                if self.gather_in_thread:
                    gather()
                write_data(path, rank, tensors)
                if rank == 0:
                    self._wait_for(path, world)
                    commit(path, everyone, values)
            except BaseException as exc:
                if not self.keeps_error:
                    raise
                self.error = exc

        if self.threaded:
            self.thread = threading.Thread(target=write, daemon=True)
            self.thread.start()
        else:
            write()
        if self.returns:
            return sum(t.numel() * t.element_size() for t in tensors)

    def _wait_for(self, path, world):
        files = [path / data_file(r) for r in range(world)]
        deadline = time.monotonic() + self.timeout
        while self.waits_for_files and not all(f.exists() for f in files):
            if self.deadline and time.monotonic() > deadline:
                missing = [f.name for f in files if not f.exists()] if self.names_missing else []
                raise TimeoutError(f"{path}: gave up after {self.timeout:g} s {missing or ''}")
            time.sleep(0.01)

    def wait(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            if self.agrees_in_wait:  # a collective on the loop's thread: allowed
                dist.barrier()
        if self.error is not None:
            error = self.error
            if self.forgets:
                self.error = None
            raise error


@pytest.mark.slow  # the judged path of a 3-rank job: `make test-slow`
def test_the_solution_passes_as_judged(sandbox):
    assert "timed out by name" in judged(sandbox, check_async_save, Saver)


def test_the_stub_says_not_implemented():
    class Stub:
        def __init__(self, timeout=60.0):
            raise NotImplementedError

    with pytest.raises(NotImplementedError, match="Exercise 8.6 is not implemented"):
        check_async_save(Stub)


@pytest.mark.slow  # a 3-rank job each: CI runs them after make test
@pytest.mark.parametrize("options, reason", [
    (dict(copies=False), "the first checkpoint holds 'w' as the training loop left it"),
    (dict(threaded=False), r"returned on rank\(s\) \[0, 1, 2\] with the data file already"),
    (dict(gather_in_thread=True), "all_gather_object ran on the background thread"),
    (dict(waits_first=False), "the second save.. returned while the first was still writing"),
    (dict(waits_for_files=False), "index before the data file rank00002.bin was on disk"),
    (dict(keeps_error=False), "failed on rank 1 .* raised nothing there"),
    (dict(deadline=False), "rank 0's wait.. was still waiting 15 s later"),
    (dict(names_missing=False), "say what is missing"),
    (dict(returns=False), r"save\(\) returned \[None, None, None\]"),
    (dict(refuses=False), "was not refused on every rank, or changed its files"),
    (dict(removes_stale=False), "before rank 2's new data file was on disk: it found the file"),
    (dict(forgets=False), "raised the failed save's error again"),
])
def test_wrong_answers_fail_with_their_reason(options, reason):
    with pytest.raises(checks.CheckFailed, match="Exercise 8.6") as info:
        check_async_save(partial(Saver, **options))
    assert re.search(reason, str(info.value), re.S), str(info.value)


@pytest.mark.slow
def test_a_collective_in_wait_on_the_loops_thread_passes(capsys):
    check_async_save(partial(Saver, agrees_in_wait=True))
    assert "✓ Exercise 8.6 passed" in capsys.readouterr().out


@pytest.mark.slow
def test_the_library_passes_the_comparison(capsys):
    from course_lib.checkpoint.async_save import AsyncCheckpointer

    check_async_save(AsyncCheckpointer)
    assert "✓ Exercise 8.6 passed" in capsys.readouterr().out


def test_the_library_is_refused(sandbox):
    from course_lib.checkpoint.async_save import AsyncCheckpointer

    with pytest.raises(checks.CheckFailed, match="course_lib.s own implementation"):
        judged(sandbox, check_async_save, AsyncCheckpointer)
