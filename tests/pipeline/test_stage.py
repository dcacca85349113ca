"""Stages built alone hold exactly the full model's parameters, by name and value."""
import pytest
import torch

from course_lib.models import GPT, GPTConfig
from course_lib.pipeline import (GPTStage, gpt_piece_costs, gpt_pieces, gpt_stage, mlp_stage,
                                 partition, sequential_stage, uneven_mlp)

CFG = GPTConfig(vocab=29, dim=16, layers=3, heads=2, seq_len=8)
SIZES = [13, 40, 7, 29, 11, 5]


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_gpt_stages_together_are_the_gpt(p):
    full = GPT(CFG, seed=7).state_dict()
    parts = [gpt_stage(CFG, s, p, seed=7).state_dict() for s in range(p)]
    names = [n for part in parts for n in part]
    assert sorted(names) == sorted(full) and len(names) == len(set(names))
    for part in parts:
        for name, tensor in part.items():
            assert torch.equal(tensor, full[name]), name


def test_gpt_stages_compose_to_the_gpt_forward():
    x = torch.randint(0, CFG.vocab, (3, CFG.seq_len))
    out = x
    for s in range(3):
        out = gpt_stage(CFG, s, 3)(out)
    torch.testing.assert_close(out, GPT(CFG)(x), rtol=1e-6, atol=1e-6)


def test_gpt_pieces_and_bad_ranges():
    assert gpt_pieces(CFG) == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert len(gpt_piece_costs(CFG)) == 5
    assert partition(gpt_piece_costs(CFG), 5) == [range(i, i + 1) for i in range(5)]
    with pytest.raises(ValueError, match="non-empty range within"):
        GPTStage(CFG, range(3, 9))


def test_mlp_stages_built_alone_equal_slices_of_the_whole():
    full = uneven_mlp(SIZES, seed=3)
    for layers in (range(0, 3), range(3, 4), range(4, 9)):
        alone, sliced = mlp_stage(SIZES, layers, seed=3), sequential_stage(full, layers)
        assert alone.state_dict().keys() == sliced.state_dict().keys()
        for name, tensor in alone.state_dict().items():
            assert torch.equal(tensor, full.state_dict()[name])
    x = torch.randn(4, SIZES[0])
    y = mlp_stage(SIZES, range(4, 9), seed=3)(mlp_stage(SIZES, range(0, 4), seed=3)(x))
    torch.testing.assert_close(y, full(x))
