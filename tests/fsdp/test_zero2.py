"""ZeRO-2 under real torchrun: one process's AdamW, a reduce-scatter and an all-gather a step."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import ship_by_value
from course_lib import run
from course_lib.fsdp import ZeRO2
from course_lib.models import deep_mlp

ship_by_value(__name__)

STEPS, ROWS = 3, 4


def _data(world):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(ROWS * world, 13, generator=gen), torch.randn(ROWS * world, 5, generator=gen)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def zero2_training():
    from course_lib import comm

    rank, world = dist.get_rank(), dist.get_world_size()
    net = deep_mlp(17, 2, inputs=13, outputs=5, seed=0)  # 17, 13, 5: sizes that do not divide
    opt = ZeRO2(net.parameters(), _adamw)
    x, y = _data(world)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    with comm.counting() as stats:
        for _ in range(STEPS):
            opt.zero_grad()
            F.mse_loss(net(x[mine]), y[mine]).backward()
            opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.numel() > 1)
    full_grads = [p.grad for p in net.parameters() if p.grad is not None]
    return ([p.detach().clone() for p in net.parameters()], state, opt.numel,
            dict(stats.collectives), len(full_grads), opt.shard.grad.numel())


def test_zero2_equals_one_process_adamw_with_shards_of_state_and_gradient():
    world = 3
    net = deep_mlp(17, 2, inputs=13, outputs=5, seed=0)
    opt = _adamw(net.parameters())
    x, y = _data(world)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    for params, state_bytes, numel, calls, full_grads, grad_shard in run(
            zero2_training, nproc=world, timeout=120):
        for got, want in zip(params, net.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        shard = -(-numel // world)
        assert state_bytes == 8 * shard  # AdamW's exp_avg and exp_avg_sq of the shard
        assert (full_grads, grad_shard) == (0, shard)  # only the shard's gradient is kept
        # 2ψ(n-1)/n per step: a reduce-scatter and an all-gather, never an all-reduce
        assert calls == {"reduce_scatter": STEPS, "all_gather": STEPS}
