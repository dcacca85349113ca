"""Sequence parallelism (stretch) under real torchrun (gloo), t = 1, 2, 3: two
blocks on (b, s/t, h) shards equal the dense blocks, outputs and every gradient;
each all-reduce becomes a reduce-scatter and an all-gather of the same size."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import tp_helpers as H
from conftest import ship_by_value
from course_lib import run
from course_lib.models import Block, GPTConfig

ship_by_value(__name__)
ship_by_value("tp_helpers")

WORLD = 3
CFG = GPTConfig(vocab=2, dim=12, layers=2, heads=6, seq_len=8)
B, S, D = 3, 6, CFG.dim  # a sequence of 6 splits over 1, 2 and 3 ranks


def dense_stack():
    return H.randomize(nn.Sequential(Block(CFG), Block(CFG)), seed=8)


def all_sequence_cases():
    from course_lib import comm
    from course_lib.tp import (gather_from_sequence, parallelize_block, scatter_to_sequence,
                               sync_sequence_parallel_grads)

    out = {}
    for t in (1, 2, 3):
        group = H.tp_group(t)
        out[t, "group"] = (dist.get_world_size(group), dist.get_rank(group))
        for kind in ("torch", "ring"):
            stack = dense_stack()
            for block in stack:
                parallelize_block(block, group, collectives=kind, sequence_parallel=True)
            x = H.seeded(40, B, S, D).requires_grad_()
            shard = scatter_to_sequence(x, group, kind)
            with comm.counting() as fwd:
                y = stack(shard)
            full = gather_from_sequence(y, group, kind, reduce_grads=False)
            with comm.counting() as bwd:
                (full * H.seeded(41, B, S, D)).sum().backward()
            with comm.counting() as sync:
                sync_sequence_parallel_grads(stack, group, kind)
            out[t, kind] = {"shard": tuple(shard.shape), "y": full.detach(), "dx": x.grad,
                            "grads": {n: p.grad for n, p in stack.named_parameters()},
                            "fwd": (dict(fwd.collectives), dict(fwd.collective_bytes)),
                            "bwd": dict(bwd.collectives), "sync": dict(sync.collectives)}
        try:
            scatter_to_sequence(torch.zeros(B, 5, D), group)
            out[t, "uneven"] = None
        except ValueError as exc:
            out[t, "uneven"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    return run(all_sequence_cases, nproc=WORLD, timeout=180)


@pytest.fixture(scope="module")
def reference():
    stack = dense_stack()
    x = H.seeded(40, B, S, D).requires_grad_()
    y = stack(x)
    (y * H.seeded(41, B, S, D)).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in stack.named_parameters()}


@pytest.mark.parametrize("t", [1, 2, 3])
@pytest.mark.parametrize("kind", ["torch", "ring"])
def test_sequence_parallel_blocks_equal_the_dense_blocks(results, reference, t, kind):
    y, dx, grads = reference
    for out in results:
        size, me = out[t, "group"]
        got = out[t, kind]
        assert got["shard"] == (B, S // size, D)
        torch.testing.assert_close(got["y"], y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["dx"], dx, rtol=1e-5, atol=1e-5)
        for name, grad in grads.items():  # LayerNorms and row biases after the sync
            torch.testing.assert_close(got["grads"][name], H.expected_shard(name, grad, me, size),
                                       rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("t", [2, 3])
def test_each_all_reduce_becomes_a_reduce_scatter_and_an_all_gather(results, t):
    activation = B * S * D * 4
    for out in results:
        size, _ = out[t, "group"]
        if size == 1:
            continue
        got = out[t, "torch"]
        # two blocks, each: all-gather before attention and MLP, reduce-scatter after
        assert got["fwd"] == ({"all_gather": 4, "reduce_scatter": 4},
                              {"all_gather": 4 * activation, "reduce_scatter": 4 * activation})
        assert got["bwd"] == {"all_gather": 4 + 1, "reduce_scatter": 4}  # + scatter's backward
        assert got["sync"] == {"all_reduce": 1}


def test_a_sequence_that_does_not_divide_is_refused(results):
    for out in results:
        for t in (1, 2, 3):
            size, _ = out[t, "group"]
            if size == 1:
                assert out[t, "uneven"] is None
            else:
                message = out[t, "uneven"]
                assert "sequence length = 5" in message and f"t = {size}" in message


def test_sequence_parallelism_needs_whole_regions():
    from course_lib.tp import parallelize

    with pytest.raises(ValueError, match="sequence_parallel needs whole regions"):
        parallelize(Block(CFG), {"mlp.0": "colwise"}, sequence_parallel=True)
