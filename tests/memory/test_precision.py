"""Mixed precision (Lab 03, section 9): each recipe's model state measured against its
table, fp32 master weights keeping the updates bf16 loses, and the bf16 ring's drift
measured under torchrun."""
import pytest
import torch
import torch.nn.functional as F

from course_lib import run
from course_lib.memory.precision import (RECIPES, FP32Master, measure_recipe,
                                         state_bytes_per_param)
from course_lib.memory.ring_precision import ring_drift
from course_lib.models import GPT, GPTConfig, deep_mlp

CFG = GPTConfig(vocab=37, dim=24, layers=2, heads=3, seq_len=9)  # sizes that divide nothing


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_holds_the_bytes_its_table_says(recipe):
    tokens = torch.randint(0, CFG.vocab, (3, CFG.seq_len), generator=torch.Generator().manual_seed(0))
    measured = measure_recipe(recipe, lambda: GPT(CFG), (tokens, tokens))
    p = sum(t.numel() for t in GPT(CFG).parameters())
    assert measured["total"] == state_bytes_per_param(recipe) * p
    assert (measured["master"] > 0) == (recipe == "bf16_master")


def test_an_unknown_recipe_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown recipe 'fp8'"):
        state_bytes_per_param("fp8")


def _train(make_step, lr, steps=8):
    """A bf16 MLP trained ``steps`` AdamW steps; its weights before and after."""
    model = deep_mlp(9, 2, inputs=5, outputs=2, seed=1).to(torch.bfloat16)
    start = [p.detach().clone() for p in model.parameters()]
    step = make_step(model, lr)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 2, generator=gen)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        F.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()
        step()
    return start, list(model.parameters()), step


def test_masters_keep_the_updates_that_bf16_weights_round_away():
    def pure(model, lr):
        return torch.optim.AdamW(model.parameters(), lr=lr).step

    def master(model, lr):
        return FP32Master(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=lr)).step

    def moved(start, after):
        return sum((a.float() - s.float()).abs().sum().item() for s, a in zip(start, after))

    lr = 1e-5  # under half a bf16 step of most weights (about 3e-5 at 0.01)
    start, pure_after, _ = _train(pure, lr, steps=30)
    start, after, step = _train(master, lr, steps=30)
    masters = step.__self__.masters
    # bf16 alone keeps a fraction of what the same updates move in fp32
    assert moved(start, pure_after) < 0.5 * moved(start, masters)
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(after, masters))
    assert moved(start, after) > moved(start, pure_after)
    assert all(m.grad is None for m in masters)


def test_a_bf16_ring_drifts_more_than_fp32_and_not_less_than_one_rounding():
    drift = run(ring_drift, sizes=(2, 3), numel=1000, nproc=3, timeout=120)[0]
    for k in (2, 3):
        assert drift[k]["fp32"] < 1e-6
        assert drift[k]["bf16"] >= drift[k]["bf16_once"] * 0.9
        assert drift[k]["bf16"] < 0.02


def test_the_drift_asks_for_enough_ranks():
    with pytest.raises(Exception, match="need 4 ranks; the job has 2"):
        run(ring_drift, sizes=(2, 4), nproc=2, timeout=60)
