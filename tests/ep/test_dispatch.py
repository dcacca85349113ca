"""Dispatch and combine in one process (Exercise 7.7's reference): the MoE built from them
equals the MoE layer, and dispatch keeps `capacity` assignments per expert, first choices
first."""
import torch

from course_lib.ep import MoE
from course_lib.ep.dispatch import combine, dispatch, moe_forward


def test_the_moe_from_dispatch_and_combine_is_the_moe():
    for top_k, factor in ((1, 1.0), (2, 0.5), (2, 4.0)):
        moe = MoE(8, 16, 4, top_k=top_k, capacity_factor=factor, seed=3)
        tokens = torch.randn(13, 8, generator=torch.Generator(device="cpu").manual_seed(1),
                             device="cpu")
        torch.testing.assert_close(moe_forward(moe, tokens), moe(tokens)[0])


def test_dispatch_keeps_the_first_assignments_and_counts_rows_per_rank():
    chosen = torch.tensor([[0, 2], [2, 1], [0, 3], [0, 2], [1, 0], [3, 2]])
    order, counts = dispatch(chosen, n_experts=4, n_ranks=2, capacity=3)
    # expert 0: assignments 0, 4, 6 (9 is over capacity); 1: 3, 8; 2: 1, 2, 7; 3: 5, 10
    assert order.tolist() == [0, 4, 6, 3, 8, 1, 2, 7, 5, 10]
    assert counts == [5, 5]
    rows = torch.arange(10.0).unsqueeze(1)
    gates = torch.ones(6, 2)
    out = combine(rows, order, gates, n_tokens=6)
    assert out.squeeze(1).tolist() == [0 + 5, 3 + 6, 1 + 8, 2 + 7, 4 + 0, 9]


def test_a_first_choice_outranks_an_earlier_tokens_second_choice():
    # expert 0 has one slot: token 1's first choice (a = 2) takes it, not token 0's second
    # (a = 1), though a = 1 comes first token by token; expert 1 likewise keeps a = 0
    order, counts = dispatch(torch.tensor([[1, 0], [0, 1]]), n_experts=2, n_ranks=2, capacity=1)
    assert order.tolist() == [2, 0] and counts == [1, 1]
