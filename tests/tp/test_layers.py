"""Column- and row-parallel linear layers under real torchrun (gloo), t = 1, 2, 3:
outputs and every gradient (weights, biases, the input) equal nn.Linear's; each
rank holds its slice and nothing of the dense weight; uneven sizes are refused."""
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import tp_helpers as H
from conftest import ship_by_value
from course_lib import run
from course_lib.models import param_by_name

ship_by_value(__name__)
ship_by_value("tp_helpers")

WORLD = 3
B, S = 3, 5  # odd batch and sequence


def dense_column():
    return H.randomize(nn.Linear(7, 6), seed=1)  # in = 7: only the output dim is split


def dense_row():
    return H.randomize(nn.Linear(6, 5), seed=2)  # out = 5: only the input dim is split


def _storage_is_own(p):
    """The parameter owns a buffer of exactly its size: not a view of a dense weight."""
    return p.untyped_storage().nbytes() == p.numel() * p.element_size()


def _run(layer, x, upstream_full, local_block=None):
    y = layer(x)
    upstream = upstream_full if local_block is None else local_block(upstream_full)
    (y * upstream).sum().backward()
    return {"y": y.detach(), "dx": x.grad,
            **{f"d{n}": p.grad for n, p in layer.named_parameters()},
            **{n: p.detach() for n, p in layer.named_parameters()},
            "own_storage": all(_storage_is_own(p) for p in layer.parameters())}


def all_layer_cases():
    from course_lib.tp import ColumnParallelLinear, RowParallelLinear

    out = {}
    for t in (1, 2, 3):
        group = H.tp_group(t)
        size, me = dist.get_world_size(group), dist.get_rank(group)
        block = lambda full: full.chunk(size, -1)[me]  # noqa: E731
        x = H.seeded(10, B, S, 7)
        up = H.seeded(11, B, S, 6)
        for gather in (False, True):
            layer = ColumnParallelLinear.from_dense(dense_column(), group, gather_output=gather)
            out[t, "column", gather] = _run(layer, x.clone().requires_grad_(), up,
                                            None if gather else block)
        x = H.seeded(12, B, S, 6)
        up = H.seeded(13, B, S, 5)
        layer = RowParallelLinear.from_dense(dense_row(), group)  # input already split
        out[t, "row", True] = _run(layer, block(x).clone().requires_grad_(), up)
        layer = RowParallelLinear.from_dense(dense_row(), group, input_is_parallel=False)
        out[t, "row", False] = _run(layer, x.clone().requires_grad_(), up)

        by_name = {"column": ColumnParallelLinear(7, 6, group=group, name="blocks.1.mlp.0", seed=4),
                   "row": RowParallelLinear(6, 5, group=group, name="blocks.1.mlp.2", seed=4),
                   "unnamed": ColumnParallelLinear(7, 6, group=group, seed=4)}
        out[t, "by_name"] = {k: (m.weight.detach(), m.bias.detach()) for k, m in by_name.items()}

        errors = []
        for make in (lambda: ColumnParallelLinear(7, 7, group=group),
                     lambda: RowParallelLinear(7, 4, group=group),
                     lambda: ColumnParallelLinear.from_dense(nn.Linear(4, 7), group),
                     lambda: RowParallelLinear.from_dense(nn.Linear(7, 4), group)):
            try:
                make()
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
        out[t, "errors"] = errors

        dense = dense_column()
        alive = weakref.ref(dense.weight)
        layer = ColumnParallelLinear.from_dense(dense, group)
        del dense
        gc.collect()
        out[t, "dense_freed"] = alive() is None
        out[t, "group"] = (size, me)
    return out


@pytest.fixture(scope="module")
def results():
    return run(all_layer_cases, nproc=WORLD, timeout=120)


def _reference(dense, x, upstream):
    x = x.clone().requires_grad_()
    y = dense(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad, dense.weight.grad, dense.bias.grad, dense


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 2, 3])
@pytest.mark.parametrize("gather", [False, True])
def test_column_parallel_matches_dense(results, t, gather):
    y, dx, dw, db, dense = _reference(dense_column(), H.seeded(10, B, S, 7), H.seeded(11, B, S, 6))
    for out in results:
        size, me = out[t, "group"]
        got = out[t, "column", gather]
        _close(got["y"], y if gather else y.chunk(size, -1)[me])
        _close(got["dx"], dx)  # f's backward all-reduce: the whole input gradient
        for name, full, grad in (("weight", dense.weight, dw), ("bias", dense.bias, db)):
            want = H.expected_shard(f"column.{name}", full.detach(), me, size)
            assert torch.equal(got[name], want)
            _close(got[f"d{name}"], H.expected_shard(f"column.{name}", grad, me, size))
        assert got["own_storage"]


@pytest.mark.parametrize("t", [1, 2, 3])
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_matches_dense_and_adds_its_bias_once(results, t, input_is_parallel):
    y, dx, dw, db, dense = _reference(dense_row(), H.seeded(12, B, S, 6), H.seeded(13, B, S, 5))
    for out in results:
        size, me = out[t, "group"]
        got = out[t, "row", input_is_parallel]
        _close(got["y"], y)
        _close(got["dx"], dx.chunk(size, -1)[me] if input_is_parallel else dx)
        want = H.expected_shard("row.weight", dense.weight.detach(), me, size)
        assert torch.equal(got["weight"], want)
        _close(got["dweight"], H.expected_shard("row.weight", dw, me, size))
        assert torch.equal(got["bias"], dense.bias.detach())  # whole, on every rank
        _close(got["dbias"], db)
        assert got["own_storage"]


@pytest.mark.parametrize("t", [1, 2, 3])
def test_a_shard_built_by_name_is_the_slice_of_the_full_parameter(results, t):
    for out in results:
        size, me = out[t, "group"]
        got = out[t, "by_name"]
        for key, prefix, shape in (("column", "blocks.1.mlp.0", (6, 7)),
                                   ("row", "blocks.1.mlp.2", (5, 6)), ("unnamed", "", (6, 7))):
            dot = f"{prefix}." if prefix else ""
            weight = param_by_name(f"{dot}weight", shape, 4)
            bias = param_by_name(f"{dot}bias", shape[:1], 4)
            kind = "row" if key == "row" else "column"
            assert torch.equal(got[key][0], H.expected_shard(f"{kind}.weight", weight, me, size))
            assert torch.equal(got[key][1], H.expected_shard(f"{kind}.bias", bias, me, size))


def test_uneven_sizes_are_value_errors_naming_the_sizes(results):
    for out in results:
        assert out[1, "errors"] == [None] * 4
        for t in (2, 3):
            size, _ = out[t, "group"]
            if size == 1:
                continue
            column, row, column_dense, row_dense = out[t, "errors"]
            for message, what in ((column, "out_features = 7"), (row, "in_features = 7"),
                                  (column_dense, "out_features = 7"),
                                  (row_dense, "in_features = 7")):
                assert message is not None and what in message and f"t = {size}" in message


@pytest.mark.parametrize("t", [1, 2, 3])
def test_from_dense_keeps_no_reference_to_the_dense_layer(results, t):
    for out in results:
        assert out[t, "dense_freed"]
