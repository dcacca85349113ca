"""Ulysses attention under torchrun (gloo) at world sizes 1-3: each rank's output and the
gradients of its q, k, v shard equal dense attention on the whole sequence (float64),
causal and not; the bytes each rank sends are the module's formula; a subgroup works with
its own ranks; heads that do not divide are refused on every rank with a clear error."""
import pytest
import torch
import torch.nn.functional as F

from conftest import ship_by_value
from course_lib import run
from course_lib.cp.ulysses import check_heads, layer_bytes_sent
from course_lib.runtime.failures import LaunchError

ship_by_value(__name__)

B, D = 2, 4


def whole(seq, heads, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(B, heads, seq, D, generator=gen, dtype=torch.float64)
            for _ in range(4)]  # q, k, v and the output's gradient


def dense(seq, heads, causal):
    q, k, v, g = (t.clone().requires_grad_() for t in whole(seq, heads))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(g.detach())
    return [out.detach(), q.grad, k.grad, v.grad]


def ulysses_job(local, heads, causal, ranks=None):
    """This rank's shard through Ulysses on the group of ``ranks`` (all by default);
    ranks outside it return None."""
    import torch.distributed as dist

    from course_lib import comm
    from course_lib.cp.ulysses import ulysses_attention

    group = dist.new_group(ranks) if ranks is not None else None
    if ranks is not None and dist.get_rank() not in ranks:
        return None
    r, n = dist.get_rank(group), dist.get_world_size(group)
    q, k, v, g = (t[:, :, r * local:(r + 1) * local] for t in whole(local * n, heads))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with comm.counting() as forward:
        out = ulysses_attention(q, k, v, group=group, causal=causal)
    with comm.counting() as backward:
        out.backward(g)
    return (out.detach(), q.grad, k.grad, v.grad, forward.sent_bytes, backward.sent_bytes)


@pytest.mark.parametrize("world,causal", [(1, True), (2, False), (3, True)])
def test_each_rank_gets_dense_attention_and_its_gradients(world, causal):
    local, heads = 5, 6  # 5 tokens a rank: the whole sequence is no power of two
    want = dense(local * world, heads, causal)
    for r, (o, dq, dk, dv, sent, sent_back) in enumerate(
            run(ulysses_job, local, heads, causal, nproc=world, timeout=120)):
        rows = slice(r * local, (r + 1) * local)
        for got, full in zip((o, dq, dk, dv), want):
            assert torch.allclose(got, full[:, :, rows], atol=1e-10)
        # q, k, v out and the output back: 4 (n-1)/n of b H (s/n) d float64 elements
        h = heads * D
        assert sent == layer_bytes_sent(B, local * world, h, world, element_size=8)
        assert sent_back == sent  # backward: the same two all-to-alls, reversed


def test_a_subgroup_uses_its_own_ranks():
    """Ranks 0 and 2 of three run Ulysses on their group; rank 2 is the group's rank 1."""
    local, heads = 3, 4
    want = dense(local * 2, heads, True)
    results = run(ulysses_job, local, heads, True, [0, 2], nproc=3, timeout=120)
    assert results[1] is None
    for group_rank, got in ((0, results[0]), (1, results[2])):
        rows = slice(group_rank * local, (group_rank + 1) * local)
        for mine, full in zip(got[:4], want):
            assert torch.allclose(mine, full[:, :, rows], atol=1e-10)


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="4 heads do not divide by 3: use ring attention"):
        check_heads(4, 3)
    with pytest.raises(LaunchError, match="do not divide by 3"):
        run(ulysses_job, 2, 4, True, nproc=3, timeout=120)


def test_ulysses_sends_n_over_2_times_less_than_the_ring():
    from course_lib.cp.traffic import layer_bytes_sent as ring_or_tp

    for n in (2, 4, 8):
        ring = ring_or_tp("cp", 1, 4096, 1024, n)
        assert ring / layer_bytes_sent(1, 4096, 1024, n) == pytest.approx(n / 2)
