"""Ring attention under torchrun (gloo) at world sizes 1-3: each rank's output and the
gradients of its q, k, v chunk equal dense attention on the whole sequence (float64),
causal and not, contiguous and zigzag; the k/v blocks travel the ring; in bf16 as close
to exact as torch's own kernel; on the CPU every block runs on the fused flash kernel,
and the textbook fallback equals dense too."""
import pytest
import torch
import torch.nn.functional as F

from conftest import ship_by_value
from course_lib import comm, run
from course_lib.cp import chunk_positions

ship_by_value(__name__)

B, H, D = 2, 3, 4


def whole(seq, seed=0, scale=1.0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [scale * torch.randn(B, H, seq, D, generator=gen, device="cpu", dtype=torch.float64)
            for _ in range(4)]  # q, k, v and the output's gradient


def ring_job(local_seq, causal, layout):
    import torch.distributed as dist

    from course_lib.cp.ring_attention import ring_attention

    rank, world = dist.get_rank(), dist.get_world_size()
    seq = local_seq * world
    pos = chunk_positions(rank, world, seq, layout)
    q, k, v, g = (t.index_select(2, pos) for t in whole(seq))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with comm.counting() as stats:
        out = ring_attention(q, k, v, causal=causal, layout=layout)
        out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad, stats.sent_messages


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("causal,layout", [(True, "contiguous"), (True, "zigzag"),
                                           (False, "contiguous")])
def test_each_rank_gets_dense_attention_and_its_gradients(world, causal, layout):
    local = 6 if layout == "zigzag" else 5  # zigzag cuts each rank's chunk in two halves
    seq = local * world
    q, k, v, g = (t.clone().requires_grad_() for t in whole(seq))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(g[...].detach())
    for rank, (o, dq, dk, dv, sent) in enumerate(run(ring_job, local, causal, layout,
                                                       nproc=world)):
        pos = chunk_positions(rank, world, seq, layout)
        for got, want in ((o, out), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
            assert torch.allclose(got, want.detach().index_select(2, pos), atol=1e-10)
        # forward: n-1 passes of the k/v block; backward: n-1 of the block ahead and n of
        # its gradient behind it, the last one home
        assert sent == (3 * (world - 1) + 1 if world > 1 else 0)


def bf16_job():
    import torch.distributed as dist

    from course_lib.cp.ring_attention import ring_attention

    rank, world = dist.get_rank(), dist.get_world_size()
    pos = chunk_positions(rank, world, 64, "zigzag")
    q, k, v, g = (t.index_select(2, pos).to(torch.bfloat16) for t in whole(64, scale=3.0))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, layout="zigzag")
    out.backward(g)
    return [t.double() for t in (out.detach(), q.grad, k.grad, v.grad)]


def test_half_precision_sums_in_fp32_as_close_as_torch_s_own_kernel():
    # bf16 inputs with large scores: ring sums kept in bf16 are several times worse
    q, k, v, g = (t.clone().requires_grad_() for t in whole(64, scale=3.0))
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    exact.backward(g)
    exact_all = [exact.detach(), q.grad, k.grad, v.grad]
    qb, kb, vb = (t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    theirs = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
    theirs.backward(g.to(torch.bfloat16))
    torch_all = [t.double() for t in (theirs.detach(), qb.grad, kb.grad, vb.grad)]

    def error(got, want):
        return ((got - want).norm() / want.norm()).item()

    ours = run(bf16_job, nproc=2, timeout=120)
    for rank, tensors in enumerate(ours):
        pos = chunk_positions(rank, 2, 64, "zigzag")
        for got, want, base in zip(tensors, exact_all, torch_all):
            want = want.index_select(2, pos)
            assert error(got, want) < 2 * error(base.index_select(2, pos), want) + 2e-3


def kernel_job(dtype, layout, fused_on):
    """Each rank's ring attention on the whole() sequence of 24 in ``dtype``, counting the
    aten ops it dispatches (forward and backward); ``fused_on`` False forces the textbook
    fallback."""
    from collections import Counter

    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from course_lib.cp import fused
    from course_lib.cp.ring_attention import ring_attention

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    pos = chunk_positions(dist.get_rank(), dist.get_world_size(), 24, layout)
    q, k, v, g = (t.index_select(2, pos).to(dtype) for t in whole(24))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    was, fused.ENABLED = fused.ENABLED, fused_on
    try:
        with Count() as count:
            out = ring_attention(q, k, v, layout=layout)
            out.backward(g)
    finally:
        fused.ENABLED = was
    return [t.double() for t in (out.detach(), q.grad, k.grad, v.grad)], dict(count.calls)


def dense_all(seq):
    q, k, v, g = (t.clone().requires_grad_() for t in whole(seq))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(g)
    return [out.detach(), q.grad, k.grad, v.grad]


CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_cpu_blocks_run_on_the_fused_kernel_one_call_per_piece(dtype, atol):
    # zigzag on 2 ranks: the own block is 3 pieces (two diagonals and the late part of
    # the queries over the early part of the keys), the other rank's block 1 rectangle
    want = dense_all(24)
    for rank, (got, calls) in enumerate(run(kernel_job, dtype, "zigzag", True, nproc=2)):
        assert calls.get(CPU_FLASH) == 4 and calls.get(CPU_FLASH + "_backward") == 4, calls
        assert "logsumexp" not in calls and "bmm" not in calls  # no textbook math
        pos = chunk_positions(rank, 2, 24, "zigzag")
        for a, b in zip(got, want):
            assert torch.allclose(a, b.index_select(2, pos), atol=atol)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_textbook_fallback_still_equals_dense(layout):
    want = dense_all(24)
    for rank, (got, calls) in enumerate(run(kernel_job, torch.float64, layout, False,
                                            nproc=3)):
        assert CPU_FLASH not in calls and calls.get("logsumexp", 0) > 0, calls
        pos = chunk_positions(rank, 3, 24, layout)
        for a, b in zip(got, want):
            assert torch.allclose(a, b.index_select(2, pos), atol=1e-10)
