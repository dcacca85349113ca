"""Wrap policies and unit plans: pure data, no processes."""
import pytest
import torch.nn as nn

from course_lib.fsdp import by_size, by_type, plan_units, prefetch_targets
from course_lib.models import GPT, Block, GPTConfig

CFG = GPTConfig(vocab=37, dim=24, layers=3, heads=4, seq_len=8)


def test_by_type_makes_one_unit_per_block_and_the_root_takes_the_rest():
    model = GPT(CFG)
    plan = plan_units(model, by_type(Block))
    assert list(plan) == ["blocks.0", "blocks.1", "blocks.2", ""]
    assert all(name.startswith("blocks.1.") for name in plan["blocks.1"])
    assert set(plan[""]) == {"tok.weight", "pos.weight", "ln_f.weight", "ln_f.bias",
                             "head.weight", "head.bias"}
    names = [n for names in plan.values() for n in names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each once


def test_no_policy_is_one_unit_and_by_size_wraps_bottom_up():
    model = GPT(CFG)
    assert list(plan_units(model)) == [""]
    block = sum(p.numel() for p in model.blocks[0].parameters())
    plan = plan_units(model, by_size(block))
    assert [u for u in plan if u.startswith("blocks.")] == ["blocks.0", "blocks.1", "blocks.2"]
    # a threshold above every block: no block reaches it, and the list of blocks, which
    # would, is a container (never called, so never a unit): all goes to the root
    plan = plan_units(model, by_size(2 * block))
    assert list(plan) == [""]


def test_a_tied_weight_belongs_to_one_unit():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    plan = plan_units(model, by_type(nn.Embedding, nn.Linear))
    assert plan == {"0": ["0.weight"], "": []}


def test_policies_reject_nonsense():
    with pytest.raises(ValueError):
        by_size(0)
    with pytest.raises(ValueError):
        by_type()


@pytest.mark.parametrize("current,depth,backward,want", [
    ("b", 1, False, ["c"]), ("b", 2, False, ["c", "d"]), ("d", 2, False, []),
    ("c", 1, True, ["b"]), ("c", 2, True, ["b", "a"]), ("a", 3, True, [""]),
    ("b", 0, False, []), ("", 1, False, ["a"])])
def test_prefetch_targets_are_the_units_that_compute_next(current, depth, backward, want):
    # forward runs the order left to right (the root "" starts first), backward right to left
    assert prefetch_targets(["", "a", "b", "c", "d"], current, depth, backward) == want


def test_a_container_never_becomes_a_unit():
    """by_size would otherwise pick ``blocks`` (a ModuleList, never called): its
    parameters then belong to the next module up that runs."""
    model = GPT(CFG)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    plan = plan_units(model, by_size(block // 2))
    assert "blocks" not in plan
    assert any(name.endswith(".mlp") for name in plan)
    assert "blocks.0.ln1.weight" in plan[""]
