"""The single-process MoE (pure): gates, capacity and the aux loss against a plain
loop; first choices served first; uniform routing gives aux = 1."""
import math

import pytest
import torch
import torch.nn.functional as F

from course_lib.ep import MoE, balance_loss, capacity, kept_assignments


def loop_reference(moe, tokens):
    """Choice by choice (every first choice, then every second), token by token within
    a choice, counting each expert's load as it goes."""
    probs = F.softmax(moe.router(tokens), -1)
    cap = capacity(tokens.shape[0], moe.top_k, moe.n_experts, moe.capacity_factor)
    load = [0] * moe.n_experts
    out = torch.zeros_like(tokens)
    for j in range(moe.top_k):
        for t in range(tokens.shape[0]):
            gates, chosen = probs[t].topk(moe.top_k)
            g, e = gates[j], int(chosen[j])
            if load[e] < cap:
                out[t] += g * moe.experts[e](tokens[t:t + 1])[0]
            load[e] += 1
    first = probs.argmax(-1)
    aux = moe.n_experts * sum((first == e).float().mean() * probs[:, e].mean()
                              for e in range(moe.n_experts))
    return out, aux


@pytest.mark.parametrize("top_k,factor", [(1, 1.0), (2, 0.6), (2, 4.0), (3, 1.25)])
def test_the_layer_equals_a_token_by_token_loop(top_k, factor):
    moe = MoE(d_model=6, d_ff=10, n_experts=5, top_k=top_k, capacity_factor=factor, seed=3)
    tokens = torch.randn(23, 6, generator=torch.Generator(device="cpu").manual_seed(1),
                         device="cpu")
    out, aux = moe(tokens)
    want, want_aux = loop_reference(moe, tokens)
    assert torch.allclose(out, want, atol=1e-6)
    assert aux.item() == pytest.approx(want_aux.item(), rel=1e-6)


def test_capacity_serves_first_choices_first():
    chosen = torch.tensor([[0], [1], [0], [0], [1], [2]])  # top-1: token order
    assert capacity(6, 1, 3, 1.0) == 2
    kept = kept_assignments(chosen, 3, cap=2)
    assert kept.squeeze(1).tolist() == [True, True, True, False, True, True]
    # top-2: token 0's second choice (expert 0) waits behind token 1's first, and loses
    # the one slot to it; served token by token it would have taken it
    kept = kept_assignments(torch.tensor([[1, 0], [0, 1], [2, 0]]), 3, cap=1)
    assert kept.tolist() == [[True, False], [True, False], [True, False]]


def test_uniform_routing_gives_an_aux_loss_of_one():
    probs = torch.full((8, 4), 0.25)
    chosen = torch.tensor([[e] for e in range(4)] * 2)
    assert balance_loss(probs, chosen, 4).item() == pytest.approx(1.0)
    skewed = torch.zeros(8, 1, dtype=torch.long)  # every first choice on expert 0
    assert balance_loss(probs, skewed, 4).item() == pytest.approx(4 * 0.25)
    assert math.isclose(balance_loss(torch.eye(4)[[0] * 8], skewed, 4).item(), 4.0)


def test_gradients_reach_the_router_and_the_experts_that_took_tokens():
    moe = MoE(d_model=4, d_ff=8, n_experts=3, top_k=2, seed=0)
    tokens = torch.randn(9, 4, generator=torch.Generator(device="cpu").manual_seed(0),
                         device="cpu")
    out, aux = moe(tokens)
    (out.sum() + aux).backward()
    assert moe.router.weight.grad.abs().sum() > 0
    used = {e for e in moe.route(tokens)[2].reshape(-1).tolist()}
    for e, expert in enumerate(moe.experts):
        assert (expert.up.weight.grad is not None) == (e in used)


def test_a_top_k_beyond_the_experts_is_refused():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 3\], got 4"):
        MoE(4, 8, n_experts=3, top_k=4)
