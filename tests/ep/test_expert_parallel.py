"""Expert parallelism under torchrun (gloo) at ep = 1, 2, 3: every rank's outputs, the
summed aux shares and every gradient equal the single-process MoE on all ranks' tokens
concatenated, with capacity drops, uneven tokens per rank and an expert no token picks."""
import pytest
import torch

from conftest import ship_by_value
from course_lib import run
from course_lib.ep import MoE

ship_by_value(__name__)

TOKENS = [5, 7, 4]  # per rank: uneven


def make_moe(top_k, factor):
    moe = MoE(d_model=6, d_ff=8, n_experts=6, top_k=top_k, capacity_factor=factor, seed=2)
    with torch.no_grad():
        moe.router.weight[5] = -10.0  # expert 5 is never chosen: it receives no token
    return moe


def data(world):
    gen = torch.Generator(device="cpu").manual_seed(7)
    tokens = [torch.randn(TOKENS[r], 6, generator=gen, device="cpu") for r in range(world)]
    grads = [torch.randn(TOKENS[r], 6, generator=gen, device="cpu") for r in range(world)]
    return tokens, grads


def ep_job(top_k, factor):
    import torch.distributed as dist

    from course_lib.ep import ExpertParallelMoE

    rank, world = dist.get_rank(), dist.get_world_size()
    layer = ExpertParallelMoE.from_dense(make_moe(top_k, factor))
    tokens, grads = data(world)
    x = tokens[rank].clone().requires_grad_()
    out, aux = layer(x)
    ((out * grads[rank]).sum() + aux).backward()
    experts = {layer.first + i: [p.grad for p in e.parameters()]
               for i, e in enumerate(layer.experts)}
    return out.detach(), aux.item(), x.grad, layer.router.weight.grad, experts


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("top_k,factor", [(2, 0.5), (1, 2.0)])
def test_expert_parallel_equals_the_dense_layer(world, top_k, factor):
    moe = make_moe(top_k, factor)
    tokens, grads = data(world)
    x = torch.cat(tokens).requires_grad_()
    out, aux = moe(x)
    ((out * torch.cat(grads)).sum() + aux).backward()
    outs = run(ep_job, top_k, factor, nproc=world)
    start = 0
    router = torch.zeros_like(moe.router.weight)
    for rank, (o, _, dx, dr, experts) in enumerate(outs):
        rows = slice(start, start + TOKENS[rank])
        assert torch.allclose(o, out.detach()[rows], atol=1e-6)
        assert torch.allclose(dx, x.grad[rows], atol=1e-6)
        router += dr
        for e, got in experts.items():
            for g, p in zip(got, moe.experts[e].parameters()):
                assert (g is None) == (p.grad is None), e
                assert g is None or torch.allclose(g, p.grad, atol=1e-6), e
        start += TOKENS[rank]
    assert sum(a for _, a, _, _, _ in outs) == pytest.approx(aux.item(), rel=1e-6)
    assert torch.allclose(router, moe.router.weight.grad, atol=1e-6)


def refused():
    from course_lib.ep import ExpertParallelMoE

    ExpertParallelMoE.from_dense(MoE(4, 8, n_experts=4))


def test_experts_that_do_not_split_over_the_ranks_are_refused():
    with pytest.raises(Exception, match="4 experts do not split over 3 ranks"):
        run(refused, nproc=3)


def one_expert_job(tokens_need_grad):
    import torch.distributed as dist

    from course_lib.ep import ExpertParallelMoE

    moe = MoE(d_model=6, d_ff=8, n_experts=2, top_k=1, capacity_factor=2.0, seed=2)
    with torch.no_grad():
        moe.router.weight[0], moe.router.weight[1] = 1.0, -1.0  # expert 0 takes every token
    layer = ExpertParallelMoE.from_dense(moe)
    tokens, grads = data(2)
    x = (tokens[dist.get_rank()].abs() + 0.1).requires_grad_(tokens_need_grad)
    out, aux = layer(x)
    ((out * grads[dist.get_rank()]).sum() + aux).backward()
    return layer.first, [None if p.grad is None else p.grad.abs().sum().item()
                         for p in layer.experts[0].parameters()]


@pytest.mark.parametrize("tokens_need_grad", [True, False])
def test_a_rank_whose_experts_keep_no_row_still_joins_every_backward_exchange(tokens_need_grad):
    # rank 1 holds expert 1, which no token picks: its forward sends and receives nothing
    # but counts, and its backward must still take part in both all-to-alls
    (first0, grads0), (first1, grads1) = run(one_expert_job, tokens_need_grad, nproc=2,
                                             timeout=60)
    assert (first0, first1) == (0, 1)
    assert all(g is not None and g > 0 for g in grads0)
    assert all(g is None for g in grads1)
