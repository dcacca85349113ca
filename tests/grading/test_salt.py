"""Hidden settings of checks seeded through torch: under a salt, every seed is mixed the
same way in the judge (per thread) and where a request runs (ranks included), and
without one seeding is torch's own."""
import threading

import torch

from conftest import ship_by_value
from course_lib.grading import salt
from course_lib.runtime.launcher import run
from course_lib.submission.calls import Request

ship_by_value(__name__)


def draws(seed=1):
    return torch.randn(4, generator=torch.Generator(device="cpu").manual_seed(seed))


def global_draws(seed=2):
    torch.manual_seed(seed)
    return torch.randn(4)


def test_a_salt_changes_every_seed_the_same_way_and_only_in_its_thread():
    plain, plain_global = draws(), global_draws()
    with salt.salted(12345):
        mixed, mixed_global = draws(), global_draws()
        assert torch.equal(draws(), mixed) and torch.equal(global_draws(), mixed_global)
        other = {}
        thread = threading.Thread(target=lambda: other.update(draws=draws()))
        thread.start()
        thread.join()
    assert not torch.equal(mixed, plain) and not torch.equal(mixed_global, plain_global)
    assert torch.equal(other["draws"], plain)  # the other notebook graded beside this one
    assert torch.equal(draws(), plain) and torch.equal(global_draws(), plain_global)
    with salt.salted(54321):
        assert not torch.equal(draws(), mixed)


def test_a_request_carries_the_salt_to_the_ranks_and_drops_it_after():
    with salt.salted(777):
        here = draws(3)
        request = salt.carried(Request("ranks", draws, (3,), {}, 2, 60.0))
    assert salt.carried(Request("ranks", draws, (3,), {}, 2, 60.0)).harness is draws  # no salt
    salted_ranks = run(request.harness, *request.args, nproc=2, backend="gloo", timeout=60)
    plain_ranks = run(draws, 3, nproc=2, backend="gloo", timeout=60)
    assert all(torch.equal(t, here) for t in salted_ranks)
    assert all(torch.equal(t, draws(3)) for t in plain_ranks)
