"""The one-page FSDP unit (Lab 03's exercises 3.5-3.7) under real torchrun, against one process."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import ship_by_value
from course_lib import comm, run
from course_lib.fsdp.unit import ShardedUnit, flatten_and_shard, full_state_dict, shard_model
from course_lib.models import GPT, Block, GPTConfig

ship_by_value(__name__)

CFG = GPTConfig(vocab=37, dim=22, layers=2, heads=2, seq_len=8)  # no unit divides by 2 or 3
ROWS, STEPS, LR = 2, 2, 1e-2


def _batch(world):
    gen = torch.Generator().manual_seed(7)
    return (torch.randint(0, CFG.vocab, (ROWS * world, CFG.seq_len), generator=gen),
            torch.randint(0, CFG.vocab, (ROWS * world, CFG.seq_len), generator=gen))


def _loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, CFG.vocab), y.reshape(-1))


def single_process(world):
    model = GPT(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = _batch(world)
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def train(reshard_after_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_model(GPT(CFG, seed=0), (Block,), reshard_after_forward=reshard_after_forward)
    units = [m for m in model.modules() if isinstance(m, ShardedUnit)]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = _batch(world)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    whole_after_forward = []
    with comm.counting() as stats:
        for _ in range(STEPS):
            opt.zero_grad()
            loss = _loss(model(x[mine]), y[mine])
            whole_after_forward.append([u.unsharded for u in units])
            loss.backward()
            opt.step()
    opt_params = sum(p.numel() for g in opt.param_groups for p in g["params"])
    return (full_state_dict(model), whole_after_forward, [u.unsharded for u in units],
            stats.as_dict(), [u.padded for u in units], opt_params)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_full_sharding_trains_as_one_process_and_frees_between_passes(world):
    want = single_process(world)
    for state, after_forward, after_backward, stats, padded, opt_params in run(
            train, True, nproc=world, timeout=120):
        assert state.keys() == want.keys()
        for name, tensor in want.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=2e-5)
        assert after_forward == [[False] * 3] * STEPS  # freed after forward...
        assert after_backward == [False] * 3  # ...and after backward
        units = len(padded)
        # per unit and step: all-gather in forward, again in backward, one reduce-scatter
        assert stats["collectives"]["all_gather"] == STEPS * 2 * units
        assert stats["collectives"]["reduce_scatter"] == STEPS * units
        assert stats["collective_bytes"]["all_gather"] == STEPS * 2 * 4 * sum(padded)
        assert opt_params == sum(padded) // world  # the optimizer sees the shards only


def test_without_resharding_the_parameters_stay_until_backward():
    want = single_process(2)
    for state, after_forward, after_backward, stats, padded, _ in run(train, False, nproc=2):
        for name, tensor in want.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=2e-5)
        assert after_forward == [[True] * 3] * STEPS and after_backward == [False] * 3
        assert stats["collectives"]["all_gather"] == STEPS * len(padded)  # gathered once


def test_flatten_and_shard_pads_and_slices():
    tensors = [torch.arange(5.0).reshape(5, 1), torch.arange(5.0, 7.0)]  # 7 elements
    shards = [flatten_and_shard(tensors, r, 3) for r in range(3)]
    assert all(padded == 9 for _, padded in shards)
    torch.testing.assert_close(torch.cat([s for s, _ in shards]),
                               torch.tensor([0., 1, 2, 3, 4, 5, 6, 0, 0]))
    assert flatten_and_shard([torch.ones(1)], 3, 4)[1] == 4  # at least one element per rank


def test_a_module_without_parameters_is_an_error():
    with pytest.raises(ValueError, match="no parameters"):  # raised before any collective
        ShardedUnit(torch.nn.ReLU())
