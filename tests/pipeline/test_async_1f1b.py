"""PipeDream's asynchronous 1F1B on real gloo ranks against one process applying the same
delayed updates (one launch per depth runs the stashed and the unstashed run), and the
stash, the versions and the table without processes."""
import pytest
import torch
import torch.nn.functional as F

from conftest import ship_by_value
from course_lib import run
from course_lib.pipeline import NoStash, WeightStash, one_f_one_b, uneven_mlp, weight_versions
from course_lib.pipeline.async_1f1b import async_mlp, mlp_stages, replay
from course_lib.pipeline.versions import expected_versions, stash_bytes, versions_table

ship_by_value(__name__)

SIZES = [13, 40, 7, 29, 11, 5]  # every cut changes the width
M, ROWS, LR = 5, 11, 0.1  # m divides by neither depth, the rows not by m


def _data():
    gen = torch.Generator().manual_seed(7)
    return torch.randn(ROWS, SIZES[0], generator=gen), torch.randn(ROWS, SIZES[-1], generator=gen)


def stashed_and_not(x, y):
    return [async_mlp(WeightStash, SIZES, x, y, M, LR), async_mlp(NoStash, SIZES, x, y, M, LR)]


@pytest.mark.parametrize("p", [2, 3])
def test_the_stashed_run_is_one_process_with_delayed_updates_and_without_it_differs(p):
    x, y = _data()
    outs = run(stashed_and_not, x, y, nproc=p, timeout=120)
    want = replay(mlp_stages(SIZES, p), x, y, F.mse_loss, LR, M)
    for s, (stashed, bare) in enumerate(outs):
        for name, tensor in stashed["state"].items():
            torch.testing.assert_close(tensor, want[s][name], rtol=1e-5, atol=1e-6)
        assert stashed["versions"] == expected_versions(p, M)[s]
        held = [b / stashed["version_bytes"] for b in stashed["held"]]
        assert max(held) == min(M, p - s) and held[-1] == 0  # one version per microbatch in flight
        assert not stashed["aliased"]
        # without a stash every backward runs on the newest weights: stage 0, the stalest,
        # ends far from the delayed updates (the others follow from its activations)
        assert all(used == now for _, used, now, _ in bare["versions"])
        assert bare["held"] == [0] * 2 * M
        if s == 0:
            assert max((bare["state"][k] - want[s][k]).abs().max().item() for k in want[s]) > 1e-4
    assert len(outs[-1][0]["losses"]) == M


def test_replay_without_stages_is_sgd_on_each_microbatch():
    x, y = _data()
    (got,) = replay([uneven_mlp(SIZES)], x, y, F.mse_loss, LR, M)
    model = uneven_mlp(SIZES)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for xs, ys in zip(x.tensor_split(M), y.tensor_split(M)):
        opt.zero_grad()
        F.mse_loss(model(xs), ys).backward()
        opt.step()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(got[name], tensor)


def test_expected_versions_and_their_table():
    p, m = 3, 5
    versions = expected_versions(p, m)
    for s, row in enumerate(weight_versions(one_f_one_b(p, m))):
        assert versions[s] == [[f, f, c, True] for _, (f, c) in sorted(row.items())]
        assert versions[s][-1][2] - versions[s][-1][0] == p - s - 1  # steady-state staleness
    lines = versions_table(versions).splitlines()
    assert lines[0].split() == ["microbatch", "0", "1", "2", "3", "4"]
    assert lines[1].split() == ["stage", "0", "forward", "on", "0", "0", "0", "1", "2"]
    assert lines[3].split() == ["staleness", "0", "1", "2", "2", "2"]
    assert lines[-1].split() == ["staleness"] + ["0"] * m
    unmatched = [[None, 0, 1, True]]
    assert versions_table([unmatched]).splitlines()[1].split()[-1] == "?"


def test_the_stash_keeps_copies_puts_them_back_for_the_block_and_frees_them():
    module = torch.nn.Linear(3, 2)
    before = [q.detach().clone() for q in module.parameters()]
    stash = WeightStash()
    stash.save(0, module)
    with torch.no_grad():  # an optimizer step, in place
        for q in module.parameters():
            q.add_(1.0)
    after = [q.detach().clone() for q in module.parameters()]
    assert stash_bytes(stash, module) == (4 * (6 + 2), False)
    with stash.restore(0, module):
        assert all(torch.equal(q, b) for q, b in zip(module.parameters(), before))
    assert all(torch.equal(q, a) for q, a in zip(module.parameters(), after))
    stash.drop(0)
    assert stash_bytes(stash, module) == (0, False)


def test_stash_bytes_sees_parameters_shared_not_the_module():
    module = torch.nn.Linear(3, 2)

    class Holder:
        def __init__(self):
            self.module = module  # the stage's own weights: not the stash's memory
            self.kept = {0: [q.detach() for q in module.parameters()]}

    assert stash_bytes(Holder(), module) == (0, True)
    assert stash_bytes(NoStash(), module) == (0, False)
