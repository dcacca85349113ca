"""Tensor parallelism on NCCL, one GPU per rank: the block (plain and sequence
parallel) against the dense block computed on the CPU here. Skipped, saying why,
where fewer than 2 GPUs are visible."""
import pytest
import torch
import torch.distributed as dist

import tp_helpers as H
from conftest import needs_gpus, ship_by_value
from course_lib import run
from course_lib.models import Block, GPTConfig

ship_by_value(__name__)
ship_by_value("tp_helpers")

pytestmark = needs_gpus(2)
CFG = GPTConfig(vocab=2, dim=24, layers=1, heads=6, seq_len=8)
B, S = 3, 6


def dense_block():
    return H.randomize(Block(CFG), seed=9)


def block_on_gpu(sequence_parallel):
    from course_lib import tp
    from course_lib.runtime.backend import current_device

    device = current_device()
    block = tp.parallelize_block(dense_block().to(device), sequence_parallel=sequence_parallel)
    x = H.seeded(50, B, S, CFG.dim).to(device).requires_grad_()
    up = H.seeded(51, B, S, CFG.dim).to(device)
    if sequence_parallel:
        y = tp.gather_from_sequence(block(tp.scatter_to_sequence(x)), reduce_grads=False)
    else:
        y = block(x)
    (y * up).sum().backward()
    if sequence_parallel:
        tp.sync_sequence_parallel_grads(block)
    return (str(x.device), y.detach(), x.grad,
            {n: p.grad for n, p in block.named_parameters()}, dist.get_rank())


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_block_on_nccl_equals_dense(sequence_parallel):
    dense = dense_block()
    x = H.seeded(50, B, S, CFG.dim).requires_grad_()
    y = dense(x)
    (y * H.seeded(51, B, S, CFG.dim)).sum().backward()
    for device, got_y, dx, grads, rank in run(block_on_gpu, sequence_parallel, nproc=2,
                                              backend="nccl", timeout=180):
        assert device == f"cuda:{rank}"
        torch.testing.assert_close(got_y, y.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dx, x.grad, rtol=1e-4, atol=1e-5)
        for name, p in dense.named_parameters():
            torch.testing.assert_close(grads[name], H.expected_shard(name, p.grad, rank, 2),
                                       rtol=1e-4, atol=1e-5, msg=name)
