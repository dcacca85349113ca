import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from course_lib.models import (GPT, Block, GPTConfig, deep_mlp, gpt_param_count,
                               init_deterministic, param_by_name, param_seed)


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


# -- weights by name: a part built alone equals its slice of the full model -----------

CFG = GPTConfig(vocab=37, dim=24, layers=4, heads=3, seq_len=11)


class MiddleStage(nn.Module):
    """A pipeline stage holding only blocks `first`..`last` of a GPT, numbered
    from 0 inside the stage, as a stage built from the config would be."""

    def __init__(self, cfg, first, last, seed):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(first, last + 1))
        for i, block in enumerate(self.blocks, start=first):
            init_deterministic(block, seed, prefix=f"blocks.{i}.")

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_stage_of_blocks_1_to_2_equals_the_full_model():
    full = GPT(CFG, seed=7)
    stage = MiddleStage(CFG, 1, 2, seed=7)
    full_params = dict(full.named_parameters())
    stage_params = list(stage.named_parameters())
    assert len(stage_params) == 2 * len(list(full.blocks[0].parameters()))
    for name, p in stage_params:
        local, rest = name.split(".", 2)[1:]
        full_name = f"blocks.{int(local) + 1}.{rest}"
        assert torch.equal(p, full_params[full_name]), full_name
    x = torch.randn(2, CFG.seq_len, CFG.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(stage(x), full.blocks[2](full.blocks[1](x)))


def test_the_prefix_may_omit_its_trailing_dot():
    a, b = Block(CFG), Block(CFG)
    init_deterministic(a, 3, prefix="blocks.3.")
    init_deterministic(b, 3, prefix="blocks.3")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("tp", [2, 3])
def test_tensor_parallel_shards_from_param_by_name_equal_slices_of_the_full_model(tp):
    full = GPT(CFG, seed=5)
    d, v = CFG.dim, CFG.vocab
    fc1 = full.blocks[3].mlp[0].weight  # (4D, D): column parallel splits outputs, dim 0
    fc2 = full.blocks[3].mlp[2].weight  # (D, 4D): row parallel splits inputs, dim 1
    rows = 4 * d // tp
    for r in range(tp):
        column = nn.Linear(d, rows)
        column.weight.data.copy_(
            param_by_name("blocks.3.mlp.0.weight", (4 * d, d), seed=5).chunk(tp, dim=0)[r])
        assert torch.equal(column.weight, fc1[r * rows:(r + 1) * rows])
        row = param_by_name("blocks.3.mlp.2.weight", (d, 4 * d), seed=5).chunk(tp, dim=1)[r]
        assert torch.equal(row, fc2[:, r * rows:(r + 1) * rows])
    # the output layer's V = 37 rows do not divide by tp: uneven shards still tile it
    shards = param_by_name("head.weight", (v, d), seed=5).tensor_split(tp, dim=0)
    assert v % tp and len({s.shape[0] for s in shards}) == 2
    assert torch.equal(torch.cat(shards), full.head.weight)


def test_same_seed_and_name_give_the_same_values_and_others_differ():
    first = param_by_name("blocks.0.attn.qkv.weight", (72, 24), seed=1)
    assert torch.equal(first, param_by_name("blocks.0.attn.qkv.weight", (72, 24), seed=1))
    assert torch.equal(first, param_by_name("blocks.0.attn.qkv.weight", torch.Size([72, 24]), 1))
    for other in [param_by_name("blocks.1.attn.qkv.weight", (72, 24), seed=1),
                  param_by_name("blocks.0.attn.qkv.weight", (72, 24), seed=2)]:
        assert not torch.equal(first, other)
    full = GPT(CFG, seed=1)
    assert not torch.equal(full.blocks[0].attn.qkv.weight, full.blocks[1].attn.qkv.weight)
    assert torch.equal(full.blocks[0].attn.qkv.weight, first)


def test_the_seed_of_a_name_does_not_depend_on_the_process():
    """Python's hash() of a str changes per process; the name's seed must not."""
    code = "from course_lib.models import param_seed; print(param_seed('blocks.2.mlp.0.weight', 9))"
    seen = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        seen.add(int(out.stdout))
    assert seen == {param_seed("blocks.2.mlp.0.weight", 9)}


def test_the_distribution_is_the_documented_one():
    model = GPT(GPTConfig(vocab=300, dim=512, layers=1, heads=4, seq_len=64), seed=0)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
    # std 0.02, shrunk by sqrt(256 / fan_in) once fan_in > 256; position embeddings 0.01
    expected = {"blocks.0.mlp.0.weight": 0.02 * (256 / 512) ** 0.5,
                "blocks.0.mlp.2.weight": 0.02 * (256 / 2048) ** 0.5,
                "pos.weight": 0.01 * (256 / 512) ** 0.5, "tok.weight": 0.02 * (256 / 512) ** 0.5}
    for name, std in expected.items():
        assert params[name].mean().abs().item() < 0.1 * std, name
        assert abs(params[name].std().item() / std - 1) < 0.05, name


def test_init_works_on_any_dtype_and_returns_the_module():
    block = Block(CFG).to(torch.bfloat16)
    assert init_deterministic(block, 4, prefix="blocks.0.") is block
    reference = param_by_name("blocks.0.attn.proj.weight", (CFG.dim, CFG.dim), 4)
    assert torch.equal(block.attn.proj.weight, reference.to(torch.bfloat16))


def test_deep_mlp_seeds_differ():
    assert not torch.equal(deep_mlp(seed=1)[0].weight, deep_mlp(seed=2)[0].weight)
