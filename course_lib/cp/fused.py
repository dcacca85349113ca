"""One block of ring attention on a fused kernel: (o_j, l_j) without the score matrix
(Lab 07).

Ring attention needs, for a block of keys K_j, V_j, the block's partial result and its
log-sum-exp (in the notation of :mod:`~course_lib.cp.blockwise`)::

    o_j = softmax(q K_j^T) V_j,        l_j = log sum_k exp(q k^T), k in K_j

to :func:`~course_lib.cp.blockwise.merge` into the running (o, l).
:func:`~course_lib.cp.blockwise.attention_with_lse` computes them with the textbook math,
the whole s_q x s_k score matrix in memory; the kernels under
``scaled_dot_product_attention`` compute the same tile by tile, and their private ops hand
back l_j as well (they keep it for their own backward):

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (float64, float32, bf16, fp16);
- CUDA: ``_scaled_dot_product_flash_attention`` (fp16, bf16) and the memory-efficient
  ``_scaled_dot_product_efficient_attention`` (float32, and half precision where flash
  cannot run).

Backward: with P_j = exp(q K_j^T - l) and D = rowsum(dO o), where o and l are the rows'
GLOBAL output and log-sum-exp (merged over every block), each op's backward returns block
j's exact share: dV_j = P_j^T dO, dS_j = P_j (dO V_j^T - D), dq_j = dS_j K_j, dK_j = dS_j^T q
(scaled); summed over the blocks they are the gradients of the whole attention. Only the
diagonal block is causal: equal lengths, query i sees keys 0..i (``is_causal``, top-left).

:func:`kernel_for` picks the kernel by device and dtype; ``None`` (float64 on CUDA, an op
this torch lacks, or ``ENABLED = False``) leaves the block to the textbook math.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

ENABLED = True  # False: every block through the textbook math (tests, comparisons)

_HALF = (torch.float16, torch.bfloat16)


def kernel_for(q):
    """``"cpu"``, ``"flash"``, ``"efficient"`` or ``None`` (the textbook math) for blocks
    of queries like ``q``, by device and dtype."""
    if not ENABLED:
        return None
    if q.device.type == "cpu":
        cpu_ok = hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu")
        return "cpu" if cpu_ok and q.dtype in (torch.float64, torch.float32, *_HALF) else None
    if q.device.type != "cuda" or q.shape[-1] % 8:  # the CUDA kernels want d % 8 == 0
        return None
    if q.dtype in _HALF and _cuda_can("flash", q):
        return "flash"
    if q.dtype in (torch.float32, *_HALF) and _cuda_can("efficient", q):
        return "efficient"
    return None


def _cuda_can(kind, q):
    """torch's own check (this GPU, this head size, the sdpa_kernel switches); False where
    this torch cannot say."""
    try:
        check = getattr(torch.backends.cuda, f"can_use_{kind}_attention")
        return bool(check(torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, False, False)))
    except (AttributeError, TypeError, RuntimeError):
        return False


def forward(kernel, q, k, v, causal):
    """(o_j, l_j) of ``q`` over the block ``k``, ``v``; ``causal``: the diagonal block."""
    if kernel == "cpu":
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    elif kernel == "flash":
        o, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    elif kernel == "efficient":
        o, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                              causal)[:2]
    else:
        raise ValueError(f"no fused kernel {kernel!r}")
    return o, lse[..., :q.shape[-2]]  # some versions pad l to a multiple of 32 queries


def backward(kernel, grad_out, q, k, v, out, lse, causal):
    """Block j's share (dq, dK_j, dV_j), given the rows' global ``out`` (o) and ``lse`` (l)."""
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal)
    lse = lse.contiguous()  # the CUDA kernels read l as (batch, heads, queries), packed
    # the dropout's random state: read only when dropout_p > 0
    seed = torch.zeros(2, dtype=torch.int64, device=q.device)
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    if kernel == "flash":  # cum_seq_q, cum_seq_k None: dense batches, not packed ones
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal,
            seed, offset)
    if kernel == "efficient":
        # it reads o in the layout its forward writes, (batch, queries, heads, d) in memory
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        return aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False],
            causal)[:3]
    raise ValueError(f"no fused kernel {kernel!r}")
