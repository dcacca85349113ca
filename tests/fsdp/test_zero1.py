"""ZeRO-1 under real torchrun: the same training as unsharded AdamW, a fraction of the state."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import ship_by_value
from course_lib import run
from course_lib.ddp import DDP
from course_lib.fsdp import ShardedOptimizer
from course_lib.models import deep_mlp

ship_by_value(__name__)

STEPS, ROWS = 3, 4


def _data(world):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(ROWS * world, 13, generator=gen), torch.randn(ROWS * world, 5, generator=gen)


def zero1_training():
    rank, world = dist.get_rank(), dist.get_world_size()
    net = deep_mlp(17, 2, inputs=13, outputs=5, seed=0)  # 17, 13, 5: sizes that do not divide
    model = DDP(net)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    x, y = _data(world)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.numel() > 1)
    return [p.detach().clone() for p in net.parameters()], state, opt.numel


@pytest.mark.parametrize("world", [1, 2, 3])
def test_zero1_equals_unsharded_adamw_with_a_shard_of_the_state(world):
    net = deep_mlp(17, 2, inputs=13, outputs=5, seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = _data(world)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    for params, state_bytes, numel in run(zero1_training, nproc=world, timeout=120):
        for got, want in zip(params, net.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        # exp_avg and exp_avg_sq of this rank's shard: 8 bytes per element of P/n (padded)
        assert state_bytes == 8 * -(-numel // world)
