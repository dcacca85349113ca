"""Lab 07's checks: pass the solutions (also as the gradebook's judge decides), fail the
stubs and these plausible wrong answers, each with its reason."""
import pytest
import torch
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib import comm
from course_lib.cp import attention_with_lse, causal_mask
from course_lib.grading import checks, lab07

ship_by_value(__name__)


# ---- 7.1: all-to-all ------------------------------------------------------------------------
def _offsets(splits):
    return [sum(splits[:p]) for p in range(len(splits))]


def all_to_all(output, input, output_splits, input_splits, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    send_at, recv_at = _offsets(input_splits), _offsets(output_splits)
    sends = [(input[send_at[p]:send_at[p] + input_splits[p]], p)
             for p in range(n) if p != r and input_splits[p]]
    recvs = [(output[recv_at[p]:recv_at[p] + output_splits[p]], p)
             for p in range(n) if p != r and output_splits[p]]
    comm.exchange(sends=sends, recvs=recvs, group=group)
    output[recv_at[r]:recv_at[r] + output_splits[r]] = input[send_at[r]:send_at[r] + input_splits[r]]


def all_to_all_even(output, input, output_splits, input_splits, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ins, outs = input.tensor_split(n), output.tensor_split(n)
    comm.exchange(sends=[(ins[p].contiguous(), p) for p in range(n) if p != r and ins[p].numel()],
                  recvs=[(outs[p], p) for p in range(n) if p != r and outs[p].numel()],
                  group=group)
    outs[r].copy_(ins[r])


def all_to_all_wrong_peer(output, input, output_splits, input_splits, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    send_at, recv_at = _offsets(input_splits), _offsets(output_splits)
    sends = [(input[send_at[p]:send_at[p] + input_splits[p]], p)
             for p in range(n) if p != r and input_splits[p]]
    # slot p filled from the peer on the other side of the ring
    recvs = [(output[recv_at[p]:recv_at[p] + output_splits[p]], (2 * r - p) % n)
             for p in range(n) if p != r and output_splits[p]]
    comm.exchange(sends=sends, recvs=recvs, group=group)
    output[recv_at[r]:recv_at[r] + output_splits[r]] = input[send_at[r]:send_at[r] + input_splits[r]]


def all_to_all_blocking(output, input, output_splits, input_splits, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    send_at, recv_at = _offsets(input_splits), _offsets(output_splits)
    for p in range(n):  # every rank sends first: each waits for a peer that is sending too
        if p != r and input_splits[p]:
            comm.send(input[send_at[p]:send_at[p] + input_splits[p]].contiguous(), p, group)
    for p in range(n):
        if p != r and output_splits[p]:
            comm.recv(output[recv_at[p]:recv_at[p] + output_splits[p]], p, group)
    output[recv_at[r]:recv_at[r] + output_splits[r]] = input[send_at[r]:send_at[r] + input_splits[r]]


def all_to_all_without_own_piece(output, input, output_splits, input_splits, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    send_at, recv_at = _offsets(input_splits), _offsets(output_splits)
    comm.exchange(sends=[(input[send_at[p]:send_at[p] + input_splits[p]], p)
                         for p in range(n) if p != r and input_splits[p]],
                  recvs=[(output[recv_at[p]:recv_at[p] + output_splits[p]], p)
                         for p in range(n) if p != r and output_splits[p]], group=group)


def all_to_all_uncounted(output, input, output_splits, input_splits, group=None):
    ins = list(input.split(input_splits))
    outs = list(output.split(output_splits))
    dist.all_to_all([o for o in outs], [i.contiguous() for i in ins], group=group)


def test_all_to_all_passes_as_judged(sandbox):
    assert "pair inside 3" in judged(sandbox, lab07.check_all_to_all, all_to_all, seed=7)


@pytest.mark.parametrize("wrong, n, reason", [
    (all_to_all_even, 2, "The splits are uneven"),
    (all_to_all_wrong_peer, 3, "but they came from rank"),
    (all_to_all_without_own_piece, 1, "copy the input rows you cut for yourself"),
])
def test_all_to_all_wrong_answers(wrong, n, reason):
    with pytest.raises(checks.CheckFailed, match=reason):
        lab07.check_all_to_all(wrong, world_sizes=(n,))


def test_all_to_all_outside_the_counted_layer_is_told_so():
    with pytest.raises(checks.CheckFailed, match="built from point-to-point messages only .*alltoall"):
        lab07.check_all_to_all(all_to_all_uncounted, world_sizes=(2,))


@pytest.mark.slow
def test_blocking_sends_in_order_deadlock_and_are_explained():
    with pytest.raises(checks.CheckFailed, match="send"):
        lab07.check_all_to_all(all_to_all_blocking, world_sizes=(2,))


# ---- 7.2: merge ----------------------------------------------------------------------------
def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = (torch.exp(lse_a - safe).unsqueeze(-1) * out_a
           + torch.exp(lse_b - safe).unsqueeze(-1) * out_b)
    return out, lse


def merge_average(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_no_rescale(out_a, lse_a, out_b, lse_b):
    return out_a + out_b, torch.logaddexp(lse_a, lse_b)


def merge_nan_on_empty_rows(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return (torch.exp(lse_a - lse).unsqueeze(-1) * out_a
            + torch.exp(lse_b - lse).unsqueeze(-1) * out_b), lse


def merge_overflowing(out_a, lse_a, out_b, lse_b):
    wa, wb = torch.exp(lse_a), torch.exp(lse_b)
    out = (wa.unsqueeze(-1) * out_a + wb.unsqueeze(-1) * out_b) / (wa + wb).unsqueeze(-1)
    return out, torch.log(wa + wb)


def merge_max_lse(out_a, lse_a, out_b, lse_b):
    return merge(out_a, lse_a, out_b, lse_b)[0], torch.maximum(lse_a, lse_b)


def test_merge_passes_as_judged(sandbox):
    assert "5 cases" in judged(sandbox, lab07.check_merge, merge, seed=7)


@pytest.mark.parametrize("wrong, reason", [
    (merge_average, "average of the two"),
    (merge_no_rescale, "must be rescaled"),
    (merge_nan_on_empty_rows, "saw no key of that block"),
    (merge_overflowing, "overflows"),
    (merge_max_lse, r"not max\(l_a, l_b\)"),
])
def test_merge_wrong_answers(wrong, reason):
    with pytest.raises(checks.CheckFailed, match=reason):
        lab07.check_merge(wrong)


# ---- 7.3: one rank's ring-attention forward --------------------------------------------------
def ring_attention_forward(q, k, v, group=None, skip=True, owner_shift=0, wait_first=False):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    s = q.shape[-2]
    kv, out, lse = torch.stack([k, v]), None, None
    for t in range(n):
        owner = (r - t + owner_shift) % n
        if t < n - 1:
            incoming = torch.empty_like(kv)
            handle = comm.exchange_async(sends=[(kv, (r + 1) % n)],
                                         recvs=[(incoming, (r - 1) % n)], group=group)
            if wait_first:  # the buffer now holds the next block, not owner's
                handle.wait()
                kv = incoming
        if owner <= r or not skip:
            mask = causal_mask(torch.arange(r * s, (r + 1) * s),
                               torch.arange(owner * s, (owner + 1) * s))
            o, l = attention_with_lse(q, kv[0], kv[1], mask)
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
        if t < n - 1 and not wait_first:
            handle.wait()
            kv = incoming
    return out


def no_causal_skip(q, k, v, group=None):
    return ring_attention_forward(q, k, v, group, skip=False)


def off_by_one_block(q, k, v, group=None):
    return ring_attention_forward(q, k, v, group, owner_shift=1)


def block_after_it_was_overwritten(q, k, v, group=None):
    return ring_attention_forward(q, k, v, group, wait_first=True)


def blocking_exchange_first(q, k, v, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    s = q.shape[-2]
    kv, out, lse = torch.stack([k, v]), None, None
    for t in range(n):
        owner = (r - t) % n
        incoming = torch.empty_like(kv)
        if t < n - 1:  # the next block arrives before this one is computed: no overlap
            comm.exchange(sends=[(kv, (r + 1) % n)], recvs=[(incoming, (r - 1) % n)],
                          group=group)
        if owner <= r:
            mask = causal_mask(torch.arange(r * s, (r + 1) * s),
                               torch.arange(owner * s, (owner + 1) * s))
            o, l = attention_with_lse(q, kv[0], kv[1], mask)
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
        kv = incoming if t < n - 1 else kv
    return out


def scores_of_every_block(q, k, v, group=None):
    n = dist.get_world_size(group)
    for block in k.new_zeros(n, *k.shape):  # q k^T of the future blocks too, then dropped
        _ = q @ block.transpose(-2, -1)
    return ring_attention_forward(q, k, v, group)


def test_ring_forward_passes_as_judged(sandbox):
    assert "r + 1 blocks" in judged(sandbox, lab07.check_ring_forward, ring_attention_forward, seed=7)


@pytest.mark.parametrize("wrong, reason", [
    (no_causal_skip, "needs only 1"),
    (off_by_one_block, "wrong values"),
    (block_after_it_was_overwritten, "wrong values"),
    (blocking_exchange_first, "nothing was computed while the first block's exchange"),
    (scores_of_every_block, "needs only 1"),
])
def test_ring_forward_wrong_answers(wrong, reason):
    with pytest.raises(checks.CheckFailed, match=reason):
        lab07.check_ring_forward(wrong, world_sizes=(2,))


# ---- 7.4: the ring's backward ------------------------------------------------------------------
def ring_attention_backward(q, k, v, out, lse, grad_out, group=None, skip=True, home=True,
                            block_softmax=False):
    """The solution's shape: k, v and their gradients travel round together, n passes,
    so after the last one every block is home with its whole gradient."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    s, scale = q.shape[-2], q.shape[-1] ** -0.5
    delta = (grad_out * out).sum(-1, keepdim=True)  # D = rowsum(dO * O)
    dq = torch.zeros_like(q)
    block = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
    for t in range(n):
        owner = (r - t) % n
        if owner <= r or not skip:
            mask = causal_mask(torch.arange(r * s, (r + 1) * s),
                               torch.arange(owner * s, (owner + 1) * s))
            scores = (q @ block[0].transpose(-2, -1)) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            if block_softmax:  # the block's own softmax instead of the saved lse
                p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
            else:
                p = torch.exp(scores - lse.unsqueeze(-1))
            block[3] += p.transpose(-2, -1) @ grad_out
            ds = p * (grad_out @ block[1].transpose(-2, -1) - delta)
            dq += ds @ block[0] * scale
            block[2] += ds.transpose(-2, -1) @ q * scale
        if n > 1 and (home or t < n - 1):
            incoming = torch.empty_like(block)
            comm.exchange(sends=[(block, (r + 1) % n)], recvs=[(incoming, (r - 1) % n)],
                          group=group)
            block = incoming
    return dq, block[2], block[3]


def ring_backward_no_skip(q, k, v, out, lse, grad_out, group=None):
    return ring_attention_backward(q, k, v, out, lse, grad_out, group, skip=False)


def ring_backward_not_home(q, k, v, out, lse, grad_out, group=None):
    """n - 1 passes: each rank ends with another rank's block gradients."""
    return ring_attention_backward(q, k, v, out, lse, grad_out, group, home=False)


def ring_backward_block_softmax(q, k, v, out, lse, grad_out, group=None):
    return ring_attention_backward(q, k, v, out, lse, grad_out, group, block_softmax=True)


def ring_backward_gathering(q, k, v, out, lse, grad_out, group=None):
    """Right gradients, wrong traffic: every rank first sends its k and v to every peer."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    kv = torch.stack([k, v])
    got = [torch.empty_like(kv) for _ in range(n)]
    comm.exchange(sends=[(kv, p) for p in range(n) if p != r],
                  recvs=[(got[p], p) for p in range(n) if p != r], group=group)
    return ring_attention_backward(q, k, v, out, lse, grad_out, group)


def test_ring_backward_passes_as_judged(sandbox):
    assert "gradients home" in judged(sandbox, lab07.check_ring_backward,
                                      ring_attention_backward, seed=7)


@pytest.mark.parametrize("wrong, world, reason", [
    (ring_backward_no_skip, 2, "skip a block whose every score is masked"),
    (ring_backward_not_home, 2, "end on its owner after the last step"),
    (ring_backward_block_softmax, 2, "from the saved lse"),
    (ring_backward_gathering, 3, "a ring sends only to the next rank"),
])
def test_ring_backward_wrong_answers(wrong, world, reason):
    with pytest.raises(checks.CheckFailed, match=reason):
        lab07.check_ring_backward(wrong, world_sizes=(world,))


# ---- 7.5: the zigzag layout ------------------------------------------------------------------
def zigzag_positions(rank, world, seq_len, contiguous=False, refuse=True):
    if refuse and seq_len % (2 * world):
        raise ValueError("does not cut")
    if contiguous:
        size = seq_len // world
        return torch.arange(rank * size, (rank + 1) * size)
    size = seq_len // (2 * world)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in (rank, 2 * world - 1 - rank)])


def zigzag_pieces(world, rank, owner, s_local, mistake=None):
    half = s_local // 2
    early, late, every = slice(0, half), slice(half, s_local), slice(0, s_local)
    if owner == rank:
        if mistake == "whole diagonal":  # right, but computes the masked quarter too
            return [(every, every, True)]
        if mistake == "own block half":  # the late queries miss the early chunk
            return [(early, early, True), (late, late, True)]
        return [(early, early, True), (late, early, False), (late, late, True)]
    if mistake == "no skip":
        return [(every, every, False)]
    if mistake == "mirrored":  # the later owner's case for an earlier one, and back
        return [(late, every, False)] if owner < rank else [(every, early, False)]
    if mistake == "twice":
        return [(every, early, False)] * 2 if owner < rank else [(late, every, False)]
    return [(every, early, False)] if owner < rank else [(late, every, False)]


def test_zigzag_passes_as_judged(sandbox):
    assert "(2n+1)/4" in judged(sandbox, lab07.check_zigzag, zigzag_positions, zigzag_pieces,
                                seed=7)


def test_zigzag_takes_slices_open_at_either_end():
    def open_ended(world, rank, owner, s_local):
        return [(slice(None, q.stop) if q.start == 0 else slice(q.start, None), k, d)
                for q, k, d in zigzag_pieces(world, rank, owner, s_local)]

    lab07.check_zigzag(zigzag_positions, open_ended)


@pytest.mark.parametrize("positions, mistake, reason", [
    (lambda r, n, s: zigzag_positions(r, n, s, contiguous=True), None, "the contiguous layout"),
    (lambda r, n, s: zigzag_positions(r, n, s).flip(0), None, "in another order"),
    (lambda r, n, s: zigzag_positions(r, n, s, refuse=False), None, "did not raise a ValueError"),
    (lambda r, n, s: zigzag_positions(r, n, s).tolist(), None, "returned a list, not a tensor"),
    (zigzag_positions, "no skip", "see keys at later positions"),
    (zigzag_positions, "mirrored", "see keys at later positions"),
    (zigzag_positions, "twice", "counted twice"),
    (zigzag_positions, "own block half", "late queries see all of the early chunk"),
    (zigzag_positions, "whole diagonal", "that quarter is skipped too"),
])
def test_zigzag_wrong_answers(positions, mistake, reason):
    with pytest.raises(checks.CheckFailed, match=reason):
        lab07.check_zigzag(positions, lambda n, r, o, s: zigzag_pieces(n, r, o, s, mistake))


# ---- 7.6: the router and its balancing loss ------------------------------------------------------
def route(logits, k, dim=-1, renormalise=False, ascending=False):
    probs = torch.softmax(logits, dim=dim)
    gates, chosen = probs.topk(k, dim=-1)
    if ascending:  # the k experts in index order, not best first
        chosen, order = chosen.sort(dim=-1)
        gates = gates.gather(-1, order)
    if renormalise:
        gates = gates / gates.sum(-1, keepdim=True)
    return probs, gates, chosen


def balance_loss(probs, chosen, every_choice=False, soft=False):
    n_experts = probs.shape[-1]
    picked = chosen if every_choice else chosen[:, :1]
    f = torch.bincount(picked.reshape(-1), minlength=n_experts).to(probs.dtype) / picked.numel()
    if soft:  # the "count" made of probabilities: a gradient through f too
        f = (torch.nn.functional.one_hot(chosen[:, 0], n_experts) * probs).sum(0) / probs.shape[0]
        f = f / f.sum()
    return n_experts * (f * probs.mean(0)).sum()


def test_router_passes_as_judged(sandbox):
    assert "token by token" in judged(sandbox, lab07.check_router, route, balance_loss, seed=7)


@pytest.mark.parametrize("wrong_route, wrong_loss, reason", [
    (lambda l, k: route(l, k, dim=0), balance_loss, "not over the tokens"),
    (lambda l, k: route(l, k, renormalise=True), balance_loss, "renormalised over the k"),
    (lambda l, k: route(l, k, ascending=True), balance_loss, "best first"),
    (route, lambda p, c: balance_loss(p, c, every_choice=True), r"first\* choice"),
    (route, lambda p, c: balance_loss(p, c, soft=True), "the balancing loss"),
    (route, lambda p, c: balance_loss(p.detach(), c), "no gradient on the logits"),
])
def test_router_wrong_answers(wrong_route, wrong_loss, reason):
    with pytest.raises(checks.CheckFailed, match=reason):
        lab07.check_router(wrong_route, wrong_loss)


# ---- 7.7: dispatch and combine ------------------------------------------------------------
def dispatch(chosen, n_experts, n_ranks, capacity, use_capacity=True, stable=True,
             per_rank=True, first_choices_first=True):
    flat = chosen.reshape(-1).tolist()
    k = chosen.shape[1]
    queue = sorted(range(len(flat)), key=lambda a: (a % k, a // k) if first_choices_first
                   else a)
    taken, kept = [0] * n_experts, []
    for a in queue:
        e = flat[a]
        if taken[e] < capacity or not use_capacity:
            taken[e] += 1
            kept.append(a)
    key = (lambda a: (flat[a], a)) if stable else (lambda a: (flat[a], -a))
    order = torch.tensor(sorted(kept, key=key), dtype=torch.long)
    experts = chosen.reshape(-1)[order]
    if per_rank:
        return order, torch.bincount(experts // (n_experts // n_ranks), minlength=n_ranks).tolist()
    return order, torch.bincount(experts, minlength=n_experts).tolist()


def combine(rows, order, gates, n_tokens, inverse=True, gated=True):
    k = gates.shape[-1]
    weights = gates.reshape(-1)[order].unsqueeze(-1) if gated else 1.0
    # without the inverse, row i is taken for assignment i, as if rows were token-major
    tokens = order // k if inverse else torch.arange(len(order)) // k
    return rows.new_zeros(n_tokens, rows.shape[-1]).index_add(0, tokens, weights * rows)


def test_dispatch_passes_as_judged(sandbox):
    assert "routings" in judged(sandbox, lab07.check_dispatch, dispatch, combine, seed=7)


@pytest.mark.parametrize("wrong_dispatch, wrong_combine, reason", [
    (lambda *a: dispatch(*a, use_capacity=False), combine, "its capacity"),
    (lambda *a: dispatch(*a, first_choices_first=False), combine,
     "served token by token: a token's later choice took"),
    (lambda *a: dispatch(*a, stable=False), combine, "within an expert, in increasing a"),
    (lambda *a: dispatch(*a, per_rank=False), combine, "one count per rank"),
    (dispatch, lambda *a: combine(*a, inverse=False), "apply the inverse"),
    (dispatch, lambda *a: combine(*a, gated=False), "weighed by its gate"),
])
def test_dispatch_wrong_answers(wrong_dispatch, wrong_combine, reason):
    with pytest.raises(checks.CheckFailed, match=reason):
        lab07.check_dispatch(wrong_dispatch, wrong_combine)


# ---- 7.8: Ulysses -----------------------------------------------------------------------------
def ulysses_attention(q, k, v, group=None, causal=True, mask=True, backward=True,
                      interleave=False, exchange=True, refuse=True):
    """The solution's shape, with switches for the wrong answers below; its all-to-all is
    the one at the top of this file (7.1's solution)."""
    import torch.nn.functional as F

    n = dist.get_world_size(group)
    if refuse and q.shape[1] % n:
        raise ValueError(f"{q.shape[1]} heads, {n} ranks")

    def swap(x, to_heads):
        b, h, s, d = x.shape
        if to_heads:
            pieces = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()
        else:
            pieces = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()
        got = torch.empty_like(pieces)
        all_to_all(got, pieces, [1] * n, [1] * n, group)  # piece p: one row of dim 0, to rank p
        if to_heads:  # interleave: the pieces side by side on d, not along the sequence
            order = (1, 2, 3, 0, 4) if interleave else (1, 2, 0, 3, 4)
            return got.permute(*order).reshape(b, h // n, n * s, d)
        return got.transpose(0, 1).reshape(b, n * h, s // n, d)

    class Swap(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, to_heads):
            ctx.to_heads = to_heads
            return swap(x, to_heads)

        @staticmethod
        def backward(ctx, grad):
            if backward:
                return swap(grad.contiguous(), not ctx.to_heads), None
            # backward=False: only the local reshape undone, no all-to-all back
            b, h, s, d = grad.shape
            if ctx.to_heads:  # (b, H/n, s, d) -> (b, H, s/n, d)
                back = grad.reshape(b, h, n, s // n, d).transpose(1, 2)
                return back.reshape(b, n * h, s // n, d), None
            back = grad.reshape(b, n, h // n, s, d).transpose(1, 2)  # (b, H, s/n, d) ->
            return back.reshape(b, h // n, n * s, d), None           # (b, H/n, s, d)

    if not exchange:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    q, k, v = (Swap.apply(t, True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal and mask)
    return Swap.apply(out, False)


def ulysses_no_mask(q, k, v, group=None, causal=True):
    return ulysses_attention(q, k, v, group, causal, mask=False)


def ulysses_no_exchange_back(q, k, v, group=None, causal=True):
    return ulysses_attention(q, k, v, group, causal, backward=False)


def ulysses_interleaved(q, k, v, group=None, causal=True):
    return ulysses_attention(q, k, v, group, causal, interleave=True)


def ulysses_no_exchange(q, k, v, group=None, causal=True):
    return ulysses_attention(q, k, v, group, causal, exchange=False)


def ulysses_without_autograd(q, k, v, group=None, causal=True):
    with torch.no_grad():  # the swaps are not recorded: nothing flows back to q, k, v
        return ulysses_attention(q, k, v, group, causal)


def ulysses_not_refusing(q, k, v, group=None, causal=True):
    return ulysses_attention(q, k, v, group, causal, refuse=False)


def ulysses_gathering_everything(q, k, v, group=None, causal=True):
    """Right values, wrong traffic: every rank gathers the whole q, k, v and output."""
    import torch.nn.functional as F

    n, r = dist.get_world_size(group), dist.get_rank(group)
    whole = []
    for t in (q, k, v):
        parts = torch.empty(n * t.shape[0], *t.shape[1:], dtype=t.dtype)
        rows = [t.shape[0]] * n
        all_to_all(parts, t.detach().repeat(n, 1, 1, 1).contiguous(), rows, rows, group)
        whole.append(torch.cat(parts.chunk(n), dim=2))
    out = ulysses_attention(q, k, v, group, causal)
    return out + 0 * F.scaled_dot_product_attention(*whole, is_causal=causal)[..., :1, :1]


def test_ulysses_passes_as_judged(sandbox):
    assert "6 heads" in judged(sandbox, lab07.check_ulysses, ulysses_attention, seed=7)


@pytest.mark.parametrize("wrong, world, reason", [
    (ulysses_no_mask, 2, "attention without the causal mask"),
    (ulysses_no_exchange_back, 2, "the backward of sequence -> heads is heads -> sequence"),
    (ulysses_interleaved, 2, "the piece from rank p being positions"),
    (ulysses_no_exchange, 2, "each rank attended only to its own tokens"),
    (ulysses_without_autograd, 2, "got no gradient"),
    (ulysses_gathering_everything, 3, "bytes sent to each peer"),
    (ulysses_not_refusing, 3, "4 heads on 3 ranks, your function raised RuntimeError"),
])
def test_ulysses_wrong_answers(wrong, world, reason):
    with pytest.raises(checks.CheckFailed, match=reason):
        lab07.check_ulysses(wrong, world_sizes=(world,))


def test_ulysses_refuses_the_library_and_torchs_differentiable_all_to_all(sandbox):
    from course_lib.cp.ulysses import ulysses_attention as library

    with pytest.raises(checks.CheckFailed, match="course_lib's own implementation"):
        judged(sandbox, lab07.check_ulysses, library)


# ---- the stubs ------------------------------------------------------------------------------
def test_stubs_say_not_implemented():
    def stub(*args, **kwargs):
        raise NotImplementedError

    for call, ex in [(lambda: lab07.check_all_to_all(stub, world_sizes=(2,)), "7.1"),
                     (lambda: lab07.check_merge(stub), "7.2"),
                     (lambda: lab07.check_ring_forward(stub, world_sizes=(2,)), "7.3"),
                     (lambda: lab07.check_ring_backward(stub, world_sizes=(2,)), "7.4"),
                     (lambda: lab07.check_zigzag(stub, stub), "7.5"),
                     (lambda: lab07.check_router(stub, stub), "7.6"),
                     (lambda: lab07.check_dispatch(stub, stub), "7.7"),
                     (lambda: lab07.check_ulysses(stub, world_sizes=(2,)), "7.8")]:
        with pytest.raises(NotImplementedError, match=f"Exercise {ex} is not implemented"):
            call()


def test_the_library_is_refused(sandbox):
    from course_lib.cp import merge as library_merge

    with pytest.raises(checks.CheckFailed, match="course_lib's own implementation"):
        judged(sandbox, lab07.check_merge, library_merge)


def test_the_librarys_backward_ring_and_router_are_refused(sandbox):
    from course_lib.cp.ring_attention import ring_backward
    from course_lib.ep.moe import balance_loss as library_loss

    with pytest.raises(checks.CheckFailed, match="course_lib's own implementation"):
        judged(sandbox, lab07.check_ring_backward, ring_backward)
    with pytest.raises(checks.CheckFailed, match="course_lib's own implementation"):
        judged(sandbox, lab07.check_router, route, library_loss)


def test_the_librarys_zigzag_is_refused(sandbox):
    from course_lib.cp.blockwise import chunk_positions

    def positions(rank, world, seq_len):
        return chunk_positions(rank, world, seq_len, "zigzag")

    with pytest.raises(checks.CheckFailed, match="course_lib's own implementation"):
        judged(sandbox, lab07.check_zigzag, positions, zigzag_pieces)
