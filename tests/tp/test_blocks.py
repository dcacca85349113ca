"""The tensor-parallel MLP, attention and transformer block under real torchrun
(gloo): equal to the dense block (outputs, every parameter's and the input's
gradient) at t = 1, 2, 3 and for tp = 2 inside a 2x2 mesh trained with data
parallelism; 2 all-reduces forward and 2 backward per block, each of b*s*h
elements; each rank's slice and nothing more; one traced step on the timeline."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tp_helpers as H
from conftest import ship_by_value
from course_lib import run
from course_lib.models import GPT, Block, GPTConfig

ship_by_value(__name__)
ship_by_value("tp_helpers")

WORLD = 3
CFG = GPTConfig(vocab=2, dim=12, layers=2, heads=6, seq_len=8)  # 12 and 6 split by 1, 2, 3
B, S, D = 3, 5, CFG.dim
KINDS = ("torch", "ring")


def dense_stack():
    """Two dense blocks with every parameter random (biases and LayerNorms too)."""
    return H.randomize(nn.Sequential(Block(CFG), Block(CFG)), seed=5)


def _step(model, x, upstream):
    from course_lib import comm

    x = x.clone().requires_grad_()
    with comm.counting() as fwd:
        y = model(x)
    with comm.counting() as bwd:
        (y * upstream).sum().backward()
    return {"y": y.detach(), "dx": x.grad,
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "params": {n: p.detach() for n, p in model.named_parameters()},
            "own_storage": {n: p.untyped_storage().nbytes() == p.numel() * p.element_size()
                            for n, p in model.named_parameters()},
            "fwd": (dict(fwd.collectives), dict(fwd.collective_bytes)),
            "bwd": (dict(bwd.collectives), dict(bwd.collective_bytes))}


def _errors(makers):
    found = []
    for make in makers:
        try:
            make()
            found.append(None)
        except ValueError as exc:
            found.append(str(exc))
    return found


def all_block_cases():
    from course_lib.tp import ParallelAttention, ParallelMLP, parallelize_block

    x, up = H.seeded(20, B, S, D), H.seeded(21, B, S, D)
    out = {}
    for t in (1, 2, 3):
        group = H.tp_group(t)
        out[t, "group"] = (dist.get_world_size(group), dist.get_rank(group))
        for kind in KINDS:
            stack = dense_stack()
            for block in stack:
                parallelize_block(block, group, collectives=kind)
            out[t, kind, "types"] = [type(b.attn).__name__ + "/" + type(b.mlp).__name__
                                     for b in stack]
            out[t, kind, "stack"] = _step(stack, x, up)
        dense = dense_stack()[0]
        out[t, "mlp"] = _step(ParallelMLP.from_dense(dense.mlp, group), x, up)
        out[t, "attn"] = _step(ParallelAttention.from_dense(dense.attn, group), x, up)
        by_name = nn.ModuleDict({
            "mlp": ParallelMLP(D, 4 * D, group=group, name="blocks.1.mlp", seed=2),
            "attn": ParallelAttention(D, CFG.heads, group=group, name="blocks.1.attn", seed=2)})
        out[t, "by_name"] = {n: p.detach() for n, p in by_name.named_parameters()}
        out[t, "errors"] = _errors([
            lambda: parallelize_block(Block(GPTConfig(dim=12, heads=4)), group),
            lambda: ParallelMLP.from_dense(nn.Sequential(nn.Linear(4, 10), nn.GELU(),
                                                         nn.Linear(10, 4)), group)])
    return out


@pytest.fixture(scope="module")
def results():
    return run(all_block_cases, nproc=WORLD, timeout=180)


@pytest.fixture(scope="module")
def reference():
    stack = dense_stack()
    return _step(stack, H.seeded(20, B, S, D), H.seeded(21, B, S, D))


def _close(got, want, what=""):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("t", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_two_blocks_equal_the_dense_blocks(results, reference, t, kind):
    for rank, out in enumerate(results):
        size, me = out[t, "group"]
        got = out[t, kind, "stack"]
        assert out[t, kind, "types"] == ["ParallelAttention/ParallelMLP"] * 2
        _close(got["y"], reference["y"], f"rank {rank} output")
        _close(got["dx"], reference["dx"], f"rank {rank} input gradient")
        assert got["grads"].keys() == reference["grads"].keys()
        for name, grad in reference["grads"].items():
            _close(got["grads"][name], H.expected_shard(name, grad, me, size),
                   f"rank {rank} gradient of {name}")


@pytest.mark.parametrize("t", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_two_all_reduces_forward_and_two_backward_per_block_of_bsh_elements(results, t, kind):
    activation = B * S * D * 4  # bytes of one all-reduce: b*s*h fp32 elements
    for out in results:
        size, _ = out[t, "group"]
        if size == 1:
            continue
        got = out[t, kind, "stack"]
        for direction in ("fwd", "bwd"):  # two blocks: 2 x 2 calls each way
            assert got[direction] == ({"all_reduce": 4}, {"all_reduce": 4 * activation})
        for part in ("mlp", "attn"):  # one column-row pair: one each way
            for direction in ("fwd", "bwd"):
                assert out[t, part][direction] == ({"all_reduce": 1}, {"all_reduce": activation})


@pytest.mark.parametrize("t", [1, 2, 3])
def test_mlp_and_attention_alone_equal_dense(results, t):
    dense = dense_stack()[0]
    for part, module in (("mlp", dense.mlp), ("attn", dense.attn)):
        want = _step(copy.deepcopy(module), H.seeded(20, B, S, D), H.seeded(21, B, S, D))
        for out in results:
            size, me = out[t, "group"]
            got = out[t, part]
            _close(got["y"], want["y"], f"{part} output")
            _close(got["dx"], want["dx"], f"{part} input gradient")
            for name, grad in want["grads"].items():
                full = f"{'attn' if part == 'attn' else 'mlp'}.{name}"
                _close(got["grads"][name], H.expected_shard(full, grad, me, size), name)


@pytest.mark.parametrize("t", [1, 2, 3])
def test_each_rank_holds_its_slice_and_no_dense_weight(results, reference, t):
    split = ("qkv.weight", "proj.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight")
    for out in results:
        size, me = out[t, "group"]
        got = out[t, "torch", "stack"]
        for name, full in reference["params"].items():
            assert torch.equal(got["params"][name], H.expected_shard(name, full, me, size)), name
            assert got["own_storage"][name], f"{name} is a view of a larger tensor"
            # 1/t of the dense tensor for what is split, and nothing else kept on the rank
            share = size if name.endswith(split) else 1
            assert got["params"][name].numel() * share == full.numel(), name
        assert got["params"].keys() == reference["params"].keys()
        assert got["params"]["0.attn.qkv.weight"].shape == (3 * D // size, D)
        assert got["params"]["0.mlp.2.weight"].shape == (D, 4 * D // size)


@pytest.mark.parametrize("t", [1, 2, 3])
def test_modules_built_by_name_are_slices_of_the_full_gpt(results, t):
    full = dict(GPT(CFG, seed=2).named_parameters())
    for out in results:
        size, me = out[t, "group"]
        for name, shard in out[t, "by_name"].items():
            want = H.expected_shard(name, full[f"blocks.1.{name}"].detach(), me, size)
            assert torch.equal(shard, want), name


def test_heads_or_hidden_sizes_that_do_not_divide_are_refused(results):
    for out in results:
        assert out[1, "errors"] == [None, None]
        heads, hidden = out[3, "errors"]
        assert "heads = 4" in heads and "t = 3" in heads
        assert "out_features = 10" in hidden and "t = 3" in hidden
        assert out[2, "errors"] == [None, None]  # 4 heads and 10 split by 2


def test_a_plan_with_an_unknown_style_or_name_changes_nothing():
    from course_lib.tp import parallelize

    block = Block(CFG)
    with pytest.raises(ValueError, match="unknown styles \\['diagonal'\\]"):
        parallelize(block, {"attn": "diagonal"})
    with pytest.raises(AttributeError):
        parallelize(block, {"mlp": "mlp", "nowhere": "mlp"})
    assert type(block.mlp) is nn.Sequential and type(block.attn).__name__ == "CausalSelfAttention"


def traced_block_step():
    from course_lib.tp import parallelize_block

    block = parallelize_block(dense_stack()[0])
    x = H.seeded(20, B, S, D).requires_grad_()
    (block(x) * H.seeded(21, B, S, D)).sum().backward()


def test_one_forward_and_backward_on_the_timeline():
    traced = run(traced_block_step, nproc=WORLD, timeout=120).trace
    for rank in range(WORLD):
        spans = sorted(traced.select(rank=rank), key=lambda s: s.start)
        order = [s.name for s in spans if s.cat in ("comm", "compute")]
        assert order == ["attention", "g: all-reduce Y", "mlp", "g: all-reduce Y",
                         "mlp backward", "f: all-reduce dX", "attention backward",
                         "f: all-reduce dX"]
        comm = [s for s in spans if s.cat == "comm"]
        assert all(s.bytes == B * S * D * 4 for s in comm)
        compute = [s for s in spans if s.cat == "compute"]
        for c in comm:  # the local work and the all-reduces take turns
            assert all(c.end <= s.start or s.end <= c.start for s in compute)


# ---- tp = 2 inside a 2x2 mesh, the other dim data parallel ----------------------------
STEPS, LR, ROWS = 3, 0.1, 2  # ROWS sequences per data-parallel rank


def _batch(dp):
    return H.seeded(30, ROWS * dp, S, D), H.seeded(31, ROWS * dp, S, D)


def train_on_mesh(kind="torch"):
    from course_lib.ddp import DDP
    from course_lib.mesh import ParallelDims
    from course_lib.tp import parallelize_block

    dims = ParallelDims(dp=2, tp=2).build()
    tp, dp = dims.group("tp"), dims.group("dp")
    stack = dense_stack()
    for block in stack:
        parallelize_block(block, tp, collectives=kind)
    # with the ring, TP's blocking all-reduces and DDP's asynchronous buckets share the
    # rank's one issuing thread: NCCL's order across the two groups (test-nccl-rules)
    model = DDP(stack, process_group=dp, all_reduce=kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _batch(2)
    mine = slice(dims.coords.dp * ROWS, (dims.coords.dp + 1) * ROWS)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    coords = dims.coords
    params = {n: p.detach().clone() for n, p in stack.named_parameters()}
    dims.destroy()
    return coords.dp, coords.tp, params


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_inside_a_2x2_mesh_trains_as_one_process_on_the_whole_batch(kind):
    dense = dense_stack()
    opt = torch.optim.SGD(dense.parameters(), lr=LR)
    x, y = _batch(2)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(dense(x), y).backward()
        opt.step()
    want = {n: p.detach() for n, p in dense.named_parameters()}
    outs = run(train_on_mesh, kind, nproc=4, timeout=180)
    assert sorted((dp, tp) for dp, tp, _ in outs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for dp, tp, params in outs:
        for name, full in want.items():
            _close(params[name], H.expected_shard(name, full, tp, 2), f"dp={dp} tp={tp} {name}")
