"""Check helpers: messages a student can act on; stubs and hangs translated."""
import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib.grading import checks

ship_by_value(__name__)


def test_expect_close_names_rank_tensor_and_first_difference():
    checks.expect_close("Exercise 9.9", torch.ones(3), torch.ones(3), rank=0, world_size=2)
    with pytest.raises(checks.CheckFailed) as info:
        checks.expect_close("Exercise 9.9", torch.tensor([1.0, 5.0, 3.0]),
                            torch.tensor([1.0, 2.0, 3.0]), rank=2, world_size=3,
                            what="the sum", hint="add, don't multiply")
    msg = str(info.value)
    assert msg.startswith("Exercise 9.9: rank 2 of world size 3, the sum: wrong values")
    assert "flat index 1: expected 2.0, got 5.0" in msg and "Hint: add, don't multiply" in msg


@pytest.mark.parametrize("got,fragment", [
    (torch.ones(4), "expected shape (3,), got (4,)"),
    (torch.ones(3, dtype=torch.int64), "expected dtype torch.float32, got torch.int64"),
    ([1.0, 1.0, 1.0], "expected a tensor, got list"),
])
def test_expect_close_catches_shape_dtype_and_type(got, fragment):
    with pytest.raises(checks.CheckFailed, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        checks.expect_close("Exercise 9.9", got, torch.ones(3), rank=0, world_size=1)


def test_expect_equal_and_passed(capsys):
    checks.expect_equal("Exercise 9.9", {1: 4}, {1: 4}, rank=0, world_size=2)
    with pytest.raises(checks.CheckFailed, match=r"expected \{1: 4\}, got \{1: 8\}"):
        checks.expect_equal("Exercise 9.9", {1: 8}, {1: 4}, rank=0, world_size=2, what="bytes")
    checks.passed("Exercise 9.9", "all good")
    assert capsys.readouterr().out == "✓ Exercise 9.9 passed (all good)\n"


def stub():
    raise NotImplementedError("Exercise 9.9: something")


def hang():
    dist.recv(torch.zeros(1), (dist.get_rank() + 1) % dist.get_world_size())


def crash():
    return 1 / 0 if dist.get_rank() == 1 else 0


def test_launch_translates_stub_hang_and_crash():
    with pytest.raises(NotImplementedError, match="Exercise 9.9 is not implemented yet"):
        checks.launch("Exercise 9.9", stub, nproc=2)
    with pytest.raises(checks.CheckFailed, match="did not finish in 5s") as info:
        checks.launch("Exercise 9.9", hang, nproc=2, timeout=5)
    assert "Hint: look for a send or recv" in str(info.value) and "in hang" in str(info.value)
    with pytest.raises(checks.CheckFailed, match="raised on rank 1 .world size 2.") as info:
        checks.launch("Exercise 9.9", crash, nproc=2)
    assert "ZeroDivisionError" in str(info.value)
