"""Ring attention: context parallelism from send/recv (Lab 07).

Each of the n ranks of ``group`` holds its chunk of the sequence of q, k and v (the
positions of :func:`~course_lib.cp.blockwise.chunk_positions` for ``layout``). The
key/value blocks travel around the ring: at step t rank r attends with its queries to
the block of rank r - t, merging the partial results by their log-sum-exp
(:func:`~course_lib.cp.blockwise.merge`), while the block sends on to rank r + 1 and
the next one arrives from rank r - 1 (the exchange runs under the compute). After n
steps every query has seen every key: the output equals dense attention on the whole
sequence. Causal attention skips a block no query of the rank may see; with the
contiguous layout rank r then computes r + 1 blocks and rank n - 1 sets the pace. Under
zigzag (chunks r and 2n-1-r) each rank's chunk is two parts, and a part of the queries
skips a part of the keys it cannot see: half of every other rank's block is skipped, and
every rank computes the same, (2n+1)/4 of a block's scores (about half of what the
contiguous layout's slowest rank computes).

Each piece of a block (a part of the queries over a part of the keys, wholly visible or
the causal diagonal) is one call of a fused attention kernel that returns (o_j, l_j)
without the score matrix (:mod:`~course_lib.cp.fused`: the kernels under
``scaled_dot_product_attention``, flash or memory-efficient), merged into the running
(o, l) with the course's ``merge``. Where no fused kernel fits (float64 on CUDA, or
``fused.ENABLED = False``), the piece goes through the textbook math of Lab 07,
:func:`~course_lib.cp.blockwise.attention_with_lse`, with the same result.

Backward is a ring too: the blocks go round again with the gradients of their keys and
values, each rank adding its queries' share (the softmax's backward needs only the
saved output and log-sum-exp: given this rank's global o and l, the fused kernel's
backward of a piece is exactly that piece's share), and after n passes every block is
home with its whole gradient. The block goes ahead under the compute as in forward; its
gradient follows one step behind, under the next block's compute. Half-precision blocks
travel (and enter the fused kernels) as they are, while the running output, log-sum-exp
and gradients are kept in fp32 (FlashAttention's rule). Shapes are
``scaled_dot_product_attention``'s: (batch, heads, local_seq, d)::

    out = ring_attention(q_chunk, k_chunk, v_chunk, group=cp_group, layout="zigzag")
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import comm, trace
from course_lib.cp import fused
from course_lib.cp.blockwise import attention_with_lse, chunk_positions, merge


def _pieces(group, owner, causal, layout, s_local):
    """:func:`pieces_seen` for this rank of ``group``."""
    return pieces_seen(dist.get_world_size(group), dist.get_rank(group), owner, causal,
                       layout, s_local)


def pieces_seen(n, r, owner, causal, layout, s_local):
    """The parts of the block of ``owner`` that rank ``r`` of ``n``'s queries see: a list of
    (query rows, key rows, diagonal), rows as slices of the local chunk, empty if no
    query sees any key. Each layout's chunk is made of equal parts (one for contiguous,
    two for zigzag), each a chunk of the sequence, so under a causal mask a part of the
    queries sees all of a part of the keys (an earlier chunk), none of it (a later one),
    or it is the same chunk: the diagonal, where query i sees keys 0..i. Pieces that
    see all of adjacent parts are one piece: under zigzag, a block of another rank is
    one rectangle, half of it."""
    if not causal:
        return [(slice(0, s_local), slice(0, s_local), False)]
    parts = 1 if layout == "contiguous" else 2
    size = s_local // parts
    q_pos = chunk_positions(r, n, n * s_local, layout)
    k_pos = chunk_positions(owner, n, n * s_local, layout)
    pieces = []
    for i in range(parts):
        rows = slice(i * size, (i + 1) * size)
        for j in range(parts):
            cols = slice(j * size, (j + 1) * size)
            first_q, first_k = int(q_pos[i * size]), int(k_pos[j * size])
            if first_q < first_k:  # a later chunk: no query of this part sees it
                continue
            pieces.append((rows, cols, first_q == first_k))
    return _joined(pieces)


def _joined(pieces):
    """Adjacent whole pieces with the same rows, then with the same keys, as one."""
    for along in (1, 0):  # keys, then queries
        out = []
        for piece in pieces:
            last = out[-1] if out else None
            if (last and not last[2] and not piece[2] and last[1 - along] == piece[1 - along]
                    and last[along].stop == piece[along].start):
                joined = slice(last[along].start, piece[along].stop)
                out[-1] = (joined, last[1], False) if along == 0 else (last[0], joined, False)
            else:
                out.append(piece)
        pieces = out
    return pieces


def piece_scores(pieces):
    """The query-key scores the pieces compute (a diagonal one counts its whole square)."""
    return sum((p[0].stop - p[0].start) * (p[1].stop - p[1].start) for p in pieces)


def _pass_right(tensor, group):
    """Send ``tensor`` to rank r + 1 and receive the same shape from r - 1; (handle, buffer).
    Untagged, as on NCCL: two passes in flight between a pair (the next K, V block and
    the gradients of the last) are told apart by the order every rank posts them in."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    incoming = torch.empty_like(tensor)
    handle = comm.exchange_async(sends=[(tensor, (r + 1) % n)], recvs=[(incoming, (r - 1) % n)],
                                 group=group)
    return handle, incoming


def _accumulator(dtype):
    """fp32 for half-precision inputs: a log-sum-exp of 10 in bf16 is off by 0.06, and
    exp(S - lse) by 6%; the blocks travel in the input's dtype, the sums do not."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _diagonal(q, k):
    """The textbook math's mask of a diagonal piece: query i sees keys 0..i."""
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()


def _block_forward(kernel, q, k, v, diagonal, acc):
    """(o_j, l_j) of one piece in the accumulator's dtype ``acc``: from the fused kernel
    (the blocks as they are), or from the textbook math (in ``acc``) if ``kernel`` is None."""
    if kernel is None:
        o, lse = attention_with_lse(q.to(acc), k.to(acc), v.to(acc),
                                    _diagonal(q, k) if diagonal else None)
    else:
        o, lse = fused.forward(kernel, q, k, v, diagonal)
    return o.to(acc), lse.to(acc)


def ring_forward(q, k, v, group, causal, layout):
    """(output, log-sum-exp) of this rank's queries over the whole sequence, both in
    :func:`_accumulator`'s dtype."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    acc, kernel = _accumulator(q.dtype), fused.kernel_for(q)
    kv = torch.stack([k, v])
    # an empty running result: every query sees at least its own key, so none stays empty
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    for t in range(n):
        owner = (r - t) % n
        pending = _pass_right(kv, group) if t < n - 1 else None  # under this block's compute
        pieces = _pieces(group, owner, causal, layout, q.shape[-2])
        if pieces:
            with trace.span(f"attention block {owner}", "compute", scores=piece_scores(pieces)):
                for rows, cols, diagonal in pieces:
                    o, l = _block_forward(kernel, q[..., rows, :], kv[0][..., cols, :],
                                          kv[1][..., cols, :], diagonal, acc)
                    out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows],
                                                              o, l)
        if pending:
            pending[0].wait()
            kv = pending[1]
    return out, lse


def _block_backward(kernel, q, kv, out, lse, grad_out, delta, pieces, dq, dkv):
    """Add this block's share to dq and to the block's dk, dv (in ``dkv``): from the
    fused kernel's backward, given the rows' global o and l, or, if ``kernel`` is None,
    from the textbook math (``delta`` = rowsum(dO O), q and dO in the accumulator's dtype)."""
    for rows, cols, diagonal in pieces:
        k_b, v_b = kv[0][..., cols, :], kv[1][..., cols, :]
        q_b, g_b = q[..., rows, :], grad_out[..., rows, :]
        if kernel is not None:
            dq_b, dk_b, dv_b = fused.backward(kernel, g_b, q_b, k_b, v_b, out[..., rows, :],
                                              lse[..., rows], diagonal)
            dq[..., rows, :] += dq_b
            dkv[0][..., cols, :] += dk_b
            dkv[1][..., cols, :] += dv_b
            continue
        scale = q.shape[-1] ** -0.5
        k_b, v_b = k_b.to(q.dtype), v_b.to(q.dtype)
        scores = (q_b @ k_b.transpose(-2, -1)) * scale
        if diagonal:
            scores = scores.masked_fill(~_diagonal(q_b, k_b), float("-inf"))
        p = torch.exp(scores - lse[..., rows].unsqueeze(-1))
        dkv[1][..., cols, :] += p.transpose(-2, -1) @ g_b
        ds = p * (g_b @ v_b.transpose(-2, -1) - delta[..., rows, :])
        dq[..., rows, :] += (ds @ k_b) * scale
        dkv[0][..., cols, :] += (ds.transpose(-2, -1) @ q_b) * scale


def ring_backward(q, k, v, out, lse, grad_out, group, causal, layout):
    """(dq, dk, dv) of this rank's chunk: dS = P (dP - D) with P = exp(S - lse),
    dP = dO V^T and D = rowsum(dO O), block by block around the ring. The k/v block
    travels ahead under the compute, as in forward; its gradient travels one step
    behind, under the next block's compute, and the last pass brings it home."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    acc, dtype, kernel = _accumulator(q.dtype), q.dtype, fused.kernel_for(q)
    delta = None
    if kernel is None:  # the textbook math runs in the accumulator's dtype
        q, grad_out = q.to(acc), grad_out.to(acc)
        delta = (grad_out * out.to(acc)).sum(-1, keepdim=True)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    behind = None  # the gradient of the block about to arrive, on its way
    for t in range(n):
        owner = (r - t) % n
        ahead = _pass_right(kv, group) if t < n - 1 else None
        dkv = torch.zeros_like(kv, dtype=acc)  # the gradients travel in fp32 too
        pieces = _pieces(group, owner, causal, layout, q.shape[-2])
        if pieces:
            with trace.span(f"attention backward block {owner}", "compute",
                            scores=piece_scores(pieces)):
                _block_backward(kernel, q, kv, out, lse, grad_out, delta, pieces, dq, dkv)
        if behind is not None:  # what the ranks before this one added to this block
            behind[0].wait()
            dkv += behind[1]
        if n > 1:
            behind = _pass_right(dkv, group)
        if ahead:
            ahead[0].wait()
            kv = ahead[1]
    if behind is not None:  # the own block, home with every rank's share
        behind[0].wait()
        dkv = behind[1]
    return dq.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype)


class RingAttention(torch.autograd.Function):
    """Forward and backward both rings (see the module's docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout):
        out, lse = ring_forward(q, k, v, group, causal, layout)
        out = out.to(q.dtype)  # lse stays in the accumulator's dtype
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout = group, causal, layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, out, lse, grad_out.contiguous(), ctx.group,
                                   ctx.causal, ctx.layout)
        return dq, dk, dv, None, None, None


def ring_attention(q, k, v, group=None, causal=True, layout="contiguous"):
    """Attention of this rank's chunk of queries over the whole sequence, which the
    ranks of ``group`` hold in chunks as ``layout`` says; differentiable."""
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"q, k and v must have one shape (batch, heads, local_seq, d), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    chunk_positions(0, dist.get_world_size(group), dist.get_world_size(group) * q.shape[-2],
                    layout)  # refuses a layout that cannot cut this sequence
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, causal,
                               layout)
