"""Blockwise attention with log-sum-exp and its merge (pure, one process): any cut of
the keys into blocks, merged in any order, equals scaled_dot_product_attention, causal
or not, with odd sizes; the layouts' positions and the causal mask."""
import pytest
import torch
import torch.nn.functional as F

from course_lib.cp import attention_with_lse, causal_mask, chunk_positions, merge


def qkv(b=2, h=3, s=11, d=5, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=gen, device="cpu", dtype=torch.float64)
            for _ in range(3)]


@pytest.mark.parametrize("cuts", [[11], [4, 7], [1, 5, 5], [3, 3, 3, 2]])
@pytest.mark.parametrize("causal", [False, True])
def test_merged_blocks_equal_dense_attention(cuts, causal):
    q, k, v = qkv()
    positions = torch.arange(11)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out = lse = None
    blocks, start = [], 0
    for size in cuts:
        blocks.append(range(start, start + size))
        start += size
    for block in blocks[::-1]:  # any order: the merge is commutative and associative
        kb, vb = k[..., block.start:block.stop, :], v[..., block.start:block.stop, :]
        mask = causal_mask(positions, positions[block.start:block.stop]) if causal else None
        o, l = attention_with_lse(q, kb, vb, mask)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    assert torch.allclose(out, want, atol=1e-12)
    assert torch.allclose(lse, torch.logsumexp(
        (q @ k.transpose(-2, -1) / 5 ** 0.5).masked_fill(
            ~causal_mask(positions, positions) if causal else torch.zeros(11, 11, dtype=bool),
            float("-inf")), -1), atol=1e-12)


def test_a_block_no_query_may_see_weighs_nothing():
    q, k, v = qkv(s=4)
    o, l = attention_with_lse(q, k, v, torch.zeros(4, 4, dtype=torch.bool))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isinf(l).all()
    full, full_lse = attention_with_lse(q, k, v)
    merged, merged_lse = merge(o, l, full, full_lse)
    assert torch.equal(merged, full) and torch.equal(merged_lse, full_lse)
    both, both_lse = merge(o, l, o, l)  # nothing seen at all: 0, not nan
    assert torch.equal(both, o) and torch.isinf(both_lse).all()


def test_layouts_cover_the_sequence_once_and_zigzag_balances_causal_work():
    for layout in ("contiguous", "zigzag"):
        held = torch.cat([chunk_positions(r, 3, 12, layout) for r in range(3)])
        assert sorted(held.tolist()) == list(range(12))
    assert chunk_positions(1, 3, 12, "zigzag").tolist() == [2, 3, 8, 9]
    whole = torch.arange(12)
    work = {layout: [int(causal_mask(chunk_positions(r, 3, 12, layout), whole).sum())
                     for r in range(3)] for layout in ("contiguous", "zigzag")}
    assert work["contiguous"] == [10, 26, 42] and len(set(work["zigzag"])) == 1


def test_a_sequence_the_layout_cannot_cut_is_refused():
    with pytest.raises(ValueError, match="a sequence of 10 does not cut into 6 equal chunks"):
        chunk_positions(0, 3, 10, "zigzag")
