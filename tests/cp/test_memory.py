"""Activation memory measured with saved-tensor hooks equals the formulas to the byte:
the dense attention layer (fused and math kernels) in one process, and the context-
parallel layer under gloo at cp = 1, 2, 3, contiguous and zigzag."""
import pytest
import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import ship_by_value
from course_lib import run
from course_lib.cp.memory import activation_bytes, dense_activation_bytes, saved_bytes
from course_lib.models import CausalSelfAttention, GPTConfig

ship_by_value(__name__)


def test_a_storage_saved_twice_counts_once_and_parameters_not_at_all():
    layer = nn.Linear(8, 16)
    x = torch.randn(5, 8, requires_grad=True)
    _, got = saved_bytes(layer, x)
    assert got == x.numel() * 4  # the weight is the layer's, only x is kept for backward
    y, got = saved_bytes(lambda a: a * a, x)  # x saved as both factors
    assert got == x.numel() * 4 and torch.equal(y, x * x)
    _, got = saved_bytes(lambda a: torch.exp(a[:, :4]), x)  # exp keeps its new result
    assert got == 5 * 4 * 4
    _, none = saved_bytes(lambda a: a + 1, x)
    assert none == 0


@pytest.mark.parametrize("batch,seq,dim,heads", [(2, 16, 32, 4), (1, 37, 24, 3), (3, 50, 48, 6), (2, 21, 16, 1)])
@pytest.mark.parametrize("kernel", ["fused", "math"])
def test_dense_attention_saves_what_the_formula_says(batch, seq, dim, heads, kernel):
    layer = CausalSelfAttention(GPTConfig(vocab=2, dim=dim, layers=1, heads=heads, seq_len=seq))
    x = torch.randn(batch, seq, dim, requires_grad=True)
    backend = SDPBackend.MATH if kernel == "math" else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel(backend):
        y, got = saved_bytes(layer, x)
    assert got == dense_activation_bytes(batch, seq, dim, heads, kernel=kernel)
    y.sum().backward()  # what was saved is enough for backward
    assert x.grad is not None


def test_the_formulas_contrast_s_squared_with_s_over_cp():
    assert activation_bytes(1, 4096, 64, 4, cp=4) * 4 == activation_bytes(1, 4096, 64, 4, cp=1)
    math = dense_activation_bytes(2, 4096, 64, 4, kernel="math")
    assert math - dense_activation_bytes(2, 4096, 64, 4) == 4 * 2 * 4 * (4096 ** 2 - 4096)
    with pytest.raises(ValueError):
        activation_bytes(1, 10, 8, 2, cp=3)


def cp_layer_bytes(batch, seq, dim, heads, layout):
    import torch.distributed as dist

    from course_lib.cp import ContextParallelAttention, chunk_positions
    from course_lib.models import init_deterministic
    from course_lib.runtime.backend import current_device

    rank, world = dist.get_rank(), dist.get_world_size()
    device = current_device()
    cfg = GPTConfig(vocab=2, dim=dim, layers=1, heads=heads, seq_len=seq)
    dense = init_deterministic(CausalSelfAttention(cfg), 0, prefix="blocks.0.attn.").to(device)
    layer = ContextParallelAttention.from_dense(dense, layout=layout)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, seq, dim, generator=gen, device="cpu").to(device)
    x = x[:, chunk_positions(rank, world, seq, layout).to(device)].requires_grad_()
    y, got = saved_bytes(layer, x)
    y.sum().backward()  # the ring's backward runs on what was saved
    return got, tuple(x.shape)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_context_parallel_attention_saves_what_the_formula_says(world, layout):
    batch, seq, dim, heads = 2, 36, 24, 3  # 36 cuts into 2 x 3 chunks (zigzag at 3 ranks)
    want = activation_bytes(batch, seq, dim, heads, cp=world)
    for got, shape in run(cp_layer_bytes, batch, seq, dim, heads, layout, nproc=world,
                          timeout=120):
        assert shape == (batch, seq // world, dim)
        assert got == want
