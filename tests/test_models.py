import pytest
import torch

from course_lib.models import GPT, GPTConfig, deep_mlp, gpt_param_count


@pytest.mark.parametrize("cfg", [GPTConfig(), GPTConfig(vocab=37, dim=24, layers=3, heads=3, seq_len=11)])
def test_gpt_has_exactly_the_lecture_parameter_count(cfg):
    assert sum(p.numel() for p in GPT(cfg).parameters()) == gpt_param_count(cfg)


def test_olmo_70b_count_from_the_lecture():
    assert gpt_param_count(GPTConfig(vocab=50280, dim=8192, layers=80, heads=64,
                                     seq_len=4096)) == 65_288_471_656


def test_gpt_shapes_causality_and_determinism():
    cfg = GPTConfig(vocab=20, dim=16, layers=2, heads=2, seq_len=8)
    a, b, other = GPT(cfg, seed=3), GPT(cfg, seed=3), GPT(cfg, seed=4)
    tokens = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(0))
    out = a(tokens)
    assert out.shape == (2, 8, 20) and torch.equal(out, b(tokens))
    assert not torch.equal(out, other(tokens))
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 20  # the future must not change the past
    assert torch.allclose(a(changed)[:, :-1], out[:, :-1], atol=1e-6)
    assert a.loss(tokens, tokens).item() > 0
    with pytest.raises(ValueError):
        a(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError):
        GPTConfig(dim=10, heads=3)


def test_deep_mlp_is_deterministic():
    assert all(torch.equal(p, q) for p, q in zip(deep_mlp(seed=1).parameters(),
                                                  deep_mlp(seed=1).parameters()))
