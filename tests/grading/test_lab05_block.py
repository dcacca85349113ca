"""Exercise 5.6, a tensor-parallel block from a blank page: the check passes the solution
(built from the student's own f, g, MLP and q/k/v slice, as in test_lab05), refuses the
library's block and the stub, and names each of these plausible wrong blocks."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conftest import judged, ship_by_value
from course_lib.grading import checks, lab05
from course_lib.tp import ParallelAttention, ParallelBlock
from test_lab05 import CopyToTP, ParallelMLP, ReduceFromTP, shard_qkv

ship_by_value(__name__)


class TPBlock(nn.Module):
    def __init__(self, block, group=None):
        super().__init__()
        self.group = group
        t, r = dist.get_world_size(group), dist.get_rank(group)
        attn = block.attn
        self.local_heads = attn.heads // t
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.qkv = nn.Parameter(shard_qkv(attn.qkv.weight.detach(), attn.heads, r, t).clone())
        self.proj_weight = nn.Parameter(attn.proj.weight.detach().chunk(t, dim=1)[r].clone())
        self.proj_bias = nn.Parameter(attn.proj.bias.detach().clone())
        self.mlp = ParallelMLP(block.mlp, group)

    def partial_attention(self, x):
        b, s, _ = x.shape
        q, k, v = F.linear(x, self.qkv).chunk(3, dim=-1)
        q, k, v = (z.view(b, s, self.local_heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(y.transpose(1, 2).reshape(b, s, -1), self.proj_weight)

    def attention(self, x):
        partial = self.partial_attention(CopyToTP.apply(x, self.group))
        return ReduceFromTP.apply(partial, self.group) + self.proj_bias

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class NoGAfterAttention(TPBlock):
    def attention(self, x):
        return self.partial_attention(CopyToTP.apply(x, self.group)) + self.proj_bias


class ResidualBeforeG(TPBlock):
    def forward(self, x):
        partial = self.partial_attention(CopyToTP.apply(self.ln1(x), self.group))
        x = ReduceFromTP.apply(x + partial, self.group) + self.proj_bias
        return x + self.mlp(self.ln2(x))


class FBeforeLayerNorm(TPBlock):  # f on the branch, but before ln1: ln1 sees a partial gradient
    def forward(self, x):
        partial = self.partial_attention(self.ln1(CopyToTP.apply(x, self.group)))
        x = x + ReduceFromTP.apply(partial, self.group) + self.proj_bias
        return x + self.mlp(self.ln2(x))


class FOnTheResidualStream(TPBlock):
    def forward(self, x):
        x = CopyToTP.apply(x, self.group)
        x = x + ReduceFromTP.apply(self.partial_attention(self.ln1(x)), self.group) \
            + self.proj_bias
        return x + self.mlp(self.ln2(x))


class ShardedLayerNorm(TPBlock):
    def __init__(self, block, group=None):
        super().__init__(block, group)
        t, r = dist.get_world_size(group), dist.get_rank(group)
        self.ln1 = nn.LayerNorm(block.ln1.normalized_shape[0] // t)
        with torch.no_grad():
            self.ln1.weight.copy_(block.ln1.weight.chunk(t)[r])
            self.ln1.bias.copy_(block.ln1.bias.chunk(t)[r])


class UsesTheLibrarysAttention(TPBlock):
    def __init__(self, block, group=None):
        super().__init__(block, group)
        self.library_attention = ParallelAttention.from_dense(block.attn, group)


def test_the_solution_passes_and_the_library_and_the_stub_do_not(capsys, monkeypatch):
    monkeypatch.setattr(checks, "_reference_guard", False)
    lab05.check_tp_block(ParallelBlock)  # the library's own block passes the same checks
    monkeypatch.setattr(checks, "_reference_guard", True)  # as in a notebook's kernel
    lab05.check_tp_block(TPBlock)
    assert capsys.readouterr().out.count("✓ Exercise 5.6 passed") == 2
    with pytest.raises(checks.CheckFailed, match="ParallelBlock is course_lib.tp.blocks"):
        lab05.check_tp_block(ParallelBlock)
    with pytest.raises(checks.CheckFailed, match="uses course_lib.tp.blocks.ParallelAttention"):
        lab05.check_tp_block(UsesTheLibrarysAttention)

    class StubBlock(nn.Module):
        def __init__(self, block, group=None):
            raise NotImplementedError("Exercise 5.6: a tensor-parallel transformer block")

    with pytest.raises(NotImplementedError, match="Exercise 5.6 is not implemented"):
        lab05.check_tp_block(StubBlock)


@pytest.mark.parametrize("block,fragment", [
    (NoGAfterAttention, "g is missing after the attention's output projection"),
    (ResidualBeforeG, "the residual was added to a partial sum before g"),
    (FBeforeLayerNorm, "gradient of ln1.weight \\(your ln1.weight\\) is this rank's part of "
                       "it only.*f belongs after the LayerNorm"),
    (FOnTheResidualStream, "gradient of the block's input X.*never the residual stream"),
    (ShardedLayerNorm, "is a 1/2 slice of ln1.weight: a LayerNorm is not split"),
])
def test_wrong_blocks_are_named(block, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=f"(?s){fragment}"):
        judged(sandbox, lab05.check_tp_block, block, world_sizes=(2,))
