"""FSDP under real torchrun (gloo) against one process on the whole batch."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conftest import ship_by_value
from course_lib import comm, run
from course_lib.fsdp import FSDP, by_size, by_type
from course_lib.models import GPT, Block, GPTConfig

ship_by_value(__name__)

# dim 22, vocab 37: no parameter tensor and no unit divides by 2 or 3 (padding used)
CFG = GPTConfig(vocab=37, dim=22, layers=3, heads=2, seq_len=8)
ROWS, STEPS, LR = 2, 3, 1e-2


def _batch(world):
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, CFG.vocab, (ROWS * world, CFG.seq_len), generator=gen)
    return x, torch.randint(0, CFG.vocab, (ROWS * world, CFG.seq_len), generator=gen)


def _model():
    model = GPT(CFG, seed=0)
    model.pos.weight.requires_grad_(False)  # a frozen parameter
    return model


def _loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, CFG.vocab), y.reshape(-1))


def single_process(world):
    model = _model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    x, y = _batch(world)
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def train(sharding, prefetch=1, hybrid=False, prefetch_plan=None, units=None, collectives="torch"):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = FSDP(_model(), units=units or by_type(Block), sharding=sharding, prefetch=prefetch,
                 mesh=mesh, prefetch_plan=prefetch_plan, collectives=collectives)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = _batch(world)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    whole_while_computing = []
    for block in model.module.blocks:  # registered after FSDP's: they see its pre-forward
        block.register_forward_pre_hook(
            lambda mod, args: whole_while_computing.append(model.unsharded_units()))
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(model(x[mine]), y[mine]).backward()
        opt.step()
    return model.full_state_dict(), whole_while_computing, model.unsharded_units()


@pytest.mark.parametrize("sharding", ["full", "grad_op", "none"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp_trains_as_one_process_on_the_whole_batch(sharding, world):
    want = single_process(world)
    for state, _, left_whole in run(train, sharding, nproc=world, timeout=120):
        assert left_whole == []  # every unit sharded again after backward
        assert state.keys() == want.keys()
        for name, tensor in want.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("collectives", ["torch", "ring"])
def test_hybrid_shard_on_a_2x2_mesh(collectives):
    """With the ring, the shard group's gathers and the replicate group's all-reduces are
    issued by one thread in one order (NCCL's rule across communicators)."""
    want = single_process(4)
    for state, _, _ in run(train, "hybrid", hybrid=True, collectives=collectives, nproc=4,
                           timeout=180):
        for name, tensor in want.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_full_parameters_exist_only_while_their_unit_computes(prefetch):
    outs = run(train, "full", prefetch=prefetch, nproc=2, timeout=120)
    for _, whole, _ in outs:
        steps = [whole[i:i + CFG.layers] for i in range(0, len(whole), CFG.layers)]
        for step in steps[1:]:  # from step 2 the forward order is known: prefetching
            for i, now in enumerate(step):
                allowed = {"", f"blocks.{i}"} | {f"blocks.{j}" for j in
                                                 range(i + 1, min(i + 1 + prefetch, CFG.layers))}
                assert f"blocks.{i}" in now and set(now) <= allowed, (i, now)
                if prefetch and i + 1 < CFG.layers:  # the next unit's all-gather is under way
                    assert f"blocks.{i + 1}" in now, (i, now)


def test_a_size_policy_with_nested_units_trains_as_one_process():
    """by_size makes each block's MLP a unit and leaves the rest of the block to the
    root: units nested in the root, and a root that is not the whole of any block."""
    want = single_process(2)
    block = sum(p.numel() for p in _model().blocks[0].parameters())
    for state, _, left_whole in run(train, "full", units=by_size(block // 2), nproc=2,
                                    timeout=120):
        assert left_whole == []
        for name, tensor in want.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=2e-5)


def skip_one(order, current, depth, backward):
    """A prefetch plan of our own: in forward, the unit two ahead (not the next)."""
    at = order.index(current)
    return [] if backward else order[at + 2:at + 3]


def test_fsdp_follows_a_given_prefetch_plan():
    for _, whole, _ in run(train, "full", prefetch_plan=skip_one, nproc=2, timeout=120):
        block_0 = whole[CFG.layers]  # step 2: the forward order is known
        assert "blocks.2" in block_0, block_0  # the default plan would be gathering blocks.1


class Stack(nn.Module):
    """Every parameter inside a unit: the root holds nothing."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5))

    def forward(self, x):
        return self.layers(x)


def counted_step(sharding):
    torch.manual_seed(0)
    model = FSDP(Stack(), units=by_type(nn.Linear), sharding=sharding, collectives="ring")
    x = torch.randn(4, 7)
    model(x).pow(2).mean().backward()  # the first step: nothing measured
    with comm.counting() as stats:
        model(x).pow(2).mean().backward()
    padded = sum(f.padded * f.full.element_size() for u in model.units for f in u.flats)
    return stats.sent_bytes, padded


@pytest.mark.parametrize("sharding,passes", [("full", 3), ("grad_op", 2)])
def test_bytes_per_step_match_the_formula(sharding, passes):
    n = 3
    for sent, psi in run(counted_step, sharding, nproc=n, timeout=120):
        assert sent == passes * psi * (n - 1) // n
