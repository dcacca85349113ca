"""Checks of Lab 05's exercises: tensor parallelism, from a split matrix to a block.

5.1 (split a matrix product by hand), the slices of 5.4 and 5.5 (communication
volume of grids) call the student's functions in the student's process and judge
what they return; 5.2 (f and g), 5.3 (a parallel MLP) and 5.4 (attention split
by heads) run the student's code under torchrun on 2 and 3 ranks, and on a pair
of ranks inside 3 (a group that is not the world), against the dense computation
done in the checking process (:mod:`.references`). All-reduces are counted per
direction on the ranks (:mod:`.jobs`): calls made through
``torch.distributed.all_reduce`` are counted, and a name imported before the
check (``from torch.distributed import all_reduce``) or another collective API is
not. The exercise text says so, and so does the message when the values are right
but nothing was counted (:mod:`.messages`). Predictions 5.1 and 5.2: :mod:`.predictions`.
5.6 (a whole tensor-parallel block, from a blank page, trained inside the GPT):
:mod:`.block`.
"""
from __future__ import annotations

import numbers

import torch

from course_lib.grading import checks, salt
from course_lib.grading.lab05 import jobs, messages, references
from course_lib.grading.lab05.block import EX_BLOCK, check_tp_block
from course_lib.grading.lab05.predictions import (check_all_reduce_count_prediction,
                                                  check_all_reduce_size_prediction)
from course_lib.grading.lab05.references import (LECTURE_A, LECTURE_X, SHARDS, dense_mlp,
                                                 group_cases, members)
from course_lib.grading.requests import call_each, here, on_ranks

EX_SPLIT, EX_FG, EX_MLP, EX_HEADS, EX_VOLUME = (f"Exercise 5.{i}" for i in range(1, 6))


def _value(ex, call, answer):
    """The value of one of ``call_each``'s answers, or the failure of ``call`` (how the
    call reads in a message) that raised."""
    if "raised" in answer:
        raise messages.raised(ex, call, answer)
    return answer["value"]


# ---- 5.1: the lecture's matrix product, split by columns and by rows ---------------------
@checks.check(EX_SPLIT, hidden=checks.reseeded)
def check_split_matmul(column_parallel_matmul, row_parallel_matmul, seed=5):
    ex = EX_SPLIT
    cases = references.split_cases(seed)
    columns = yield here(call_each, column_parallel_matmul,
                         [((x.clone(), a.clone(), t_col), {}) for x, a, t_col, _ in cases])
    rows = yield here(call_each, row_parallel_matmul,
                      [((x.clone(), a.clone(), t_row), {}) for x, a, _, t_row in cases])
    for (x, a, t_col, t_row), column, row in zip(cases, columns, rows):
        shape = f"X {tuple(x.shape)}, A {tuple(a.shape)}"
        got = _value(ex, f"column_parallel_matmul({shape}, t={t_col})", column)
        got = messages.as_list(ex, got, t_col, "column_parallel_matmul")
        for i, (block, a_i) in enumerate(zip(got, a.chunk(t_col, dim=1))):
            want = x @ a_i
            if isinstance(block, torch.Tensor) and block.shape != want.shape:
                raise messages.column_block_shape(ex, shape, t_col, i, block, want)
            checks.expect_close(ex, block, want, rank=i, world_size=t_col,
                                what=f"column_parallel_matmul({shape}), block Y_{i + 1}",
                                hint="Y_i = X @ A[:, columns of GPU i]")
        got = _value(ex, f"row_parallel_matmul({shape}, t={t_row})", row)
        if messages.is_data_parallel(got, x, a):
            raise messages.data_parallel(ex, shape, t_row)
        got = messages.as_list(ex, got, t_row, "row_parallel_matmul")
        parts = zip(x.chunk(t_row, dim=1), a.chunk(t_row, dim=0))
        for i, (block, (x_i, a_i)) in enumerate(zip(got, parts)):
            want = x_i @ a_i
            if isinstance(block, torch.Tensor) and block.shape != want.shape:
                raise messages.row_block_shape(ex, shape, t_row, i, block, want)
            checks.expect_close(ex, block, want, rank=i, world_size=t_row,
                                what=f"row_parallel_matmul({shape}), partial product {i + 1}",
                                hint="X_i = X[:, block i of the columns], A_i = A[block i "
                                     "of the rows, :]")
    return f"the lecture's example and {len(cases) - 1} random shapes, by columns and by rows"


# ---- 5.2: f and g ---------------------------------------------------------------------
@checks.check(EX_FG, hidden=salt.draw)
def check_f_and_g(copy_to_tp, reduce_from_tp, world_sizes=(2, 3)):
    ex = EX_FG
    for n in world_sizes:
        for where, use_pair in group_cases(n):
            outs = yield on_ranks(jobs.fg_job, copy_to_tp, reduce_from_tp, use_pair, nproc=n)
            for rank, (f, g) in enumerate(outs):
                group = members(n, use_pair, rank)
                messages.grade_f(ex, f, rank, n, len(group), where, *references.f_expected(group))
                messages.grade_g(ex, g, rank, n, len(group), where,
                                 *references.g_expected(rank, group))
    return (f"world sizes {list(world_sizes)} and a group of 2 inside 3: values, input "
            f"gradients, one all-reduce each, in the right direction")


# ---- 5.3: a parallel MLP --------------------------------------------------------------
@checks.check(EX_MLP, hidden=salt.draw)
def check_parallel_mlp(mlp_class, world_sizes=(2, 3)):
    ex = EX_MLP
    dense = references.dense_mlp_reference()
    for n in world_sizes:
        for where, use_pair in group_cases(n):
            outs = yield on_ranks(jobs.mlp_job, mlp_class, use_pair, nproc=n)
            for rank, (params, result, error) in enumerate(outs):
                group = members(n, use_pair, rank)
                _grade_mlp(ex, params, result, error, rank, n, len(group), group.index(rank),
                           where, *dense)
    return (f"world sizes {list(world_sizes)} and a group of 2 inside 3: each rank's slices, "
            f"output, every gradient, one all-reduce each way")


def _grade_mlp(ex, params, result, error, rank, n, t, me, where, y_want, dx_want, full, grads):
    say = dict(rank=rank, world_size=n)
    if set(params) != set(SHARDS):
        raise messages.parameter_names(ex, rank, sorted(params))
    for name, (what, dim) in SHARDS.items():
        want = references.shard(full[name], dim, me, t)
        if params[name].shape != want.shape:
            raise messages.shard_shape(ex, rank, where, t, name, what, dim, params[name], want)
        checks.expect_close(ex, params[name], want, **say, what=f"{name} ({what}) on this rank",
                            hint=f"take slice {me} of {t} of the dense parameter")
    if error is not None:
        raise checks.CheckFailed(f"{ex}: rank {rank} (group = {where}): forward or backward "
                                 f"raised {error}")
    y, dx, got_grads, fwd, bwd = result
    if t > 1 and (fwd, bwd) == (0, 0) and messages.close(y, y_want) \
            and messages.close(dx, dx_want):
        raise messages.not_counted(ex, rank, where, "the MLP's output and input gradient are")
    if t > 1 and (fwd, bwd) != (1, 1):
        raise messages.all_reduce_count(ex, rank, where, fwd, bwd)
    if t > 1 and messages.close(y, y_want + (t - 1) * full["b2"]):
        raise messages.bias_on_every_rank(ex, rank, where, t)
    checks.expect_close(ex, y, y_want, **say, rtol=1e-5, atol=1e-5, what="the MLP's output",
                        hint="Y = g(GELU(f(X) A_r + a_r) B_r) + b")
    checks.expect_close(ex, dx, dx_want, **say, rtol=1e-5, atol=1e-5,
                        what="the gradient of the MLP's input X",
                        hint="X's gradient must be summed over the ranks: X goes through f "
                             "(CopyToTP) before the first layer")
    for name, (what, dim) in SHARDS.items():
        checks.expect_close(ex, got_grads[name], references.shard(grads[name], dim, me, t), **say,
                            rtol=1e-5, atol=1e-5, what=f"the gradient of {name} ({what})")


# ---- 5.4: attention split by heads ------------------------------------------------------
@checks.check(EX_HEADS, hidden=lambda rng: {"cases": references.drawn_qkv_cases(rng)})
def check_shard_qkv(shard_qkv, world_sizes=(2, 3), cases=tuple(references.QKV_CASES)):
    ex = EX_HEADS
    layouts = [(heads, t, rank) for heads, t in cases for rank in range(t)]
    weights = {(heads, t): references.qkv_weight(heads, t) for heads, t in cases}
    calls = [((weights[heads, t].clone(), heads, rank, t), {}) for heads, t, rank in layouts]
    calls.append(((torch.zeros(12, 4, device="cpu"), 4, 0, 3), {}))  # 4 heads over 3 ranks
    answers = yield here(call_each, shard_qkv, calls)
    for (heads, t, rank), answer in zip(layouts, answers):
        weight = weights[heads, t]
        what = f"shard_qkv(weight {tuple(weight.shape)}, heads={heads}, rank={rank}, t={t})"
        got = _value(ex, what, answer)
        want = references.expected_qkv(weight, rank, t)
        if isinstance(got, torch.Tensor) and got.shape == want.shape and t > 1 \
                and torch.equal(got, weight.chunk(t, dim=0)[rank]):
            raise messages.contiguous_qkv(ex, what, t)
        checks.expect_close(ex, got, want, rank=rank, world_size=t, what=what,
                            hint="rows [r*h/t, (r+1)*h/t) of q, of k and of v, in that "
                                 "order (h = the model width)")
    bad = answers[-1]
    if bad.get("raised") == "ValueError":
        if "4" not in bad["message"] or "3" not in bad["message"]:
            raise checks.CheckFailed(f"{ex}: the ValueError for heads=4, t=3 says "
                                     f"{ValueError(bad['message'])!r}; name both numbers")
    elif "raised" in bad:
        raise checks.CheckFailed(f"{ex}: shard_qkv(weight, heads=4, rank=0, t=3) raised "
                                 f"{bad['raised']}: {bad['message']}; expected a ValueError: 4 "
                                 f"heads do not split over 3 ranks")
    else:
        raise checks.CheckFailed(f"{ex}: shard_qkv(weight, heads=4, rank=0, t=3) returned; "
                                 f"expected a ValueError: 4 heads do not split over 3 ranks")
    y_want, dx_want = references.dense_heads()
    for n in world_sizes:
        for where, use_pair in group_cases(n):
            outs = yield on_ranks(jobs.heads_job, shard_qkv, use_pair, nproc=n)
            for rank, (y, dx) in enumerate(outs):
                for got, want, what in ((y, y_want, "output"), (dx, dx_want, "input gradient")):
                    checks.expect_close(ex, got, want, rank=rank, world_size=n, rtol=1e-5,
                                        atol=1e-5, what=f"the attention's {what} with your "
                                                        f"slices (group = {where})")
    return (f"{len(references.QKV_CASES)} head/rank layouts, the ValueError, and attention "
            f"equal to dense on world sizes {list(world_sizes)}")


# ---- 5.5: communication volume on 1D, 2D and 3D grids ------------------------------------
@checks.check(EX_VOLUME, hidden=checks.reseeded)
def check_layer_volume(layer_volume, trials=60, seed=9):
    ex = EX_VOLUME
    cases = references.volume_cases(trials, seed)
    answers = yield here(call_each, layer_volume, [(case, {}) for case in cases])
    for (m, k, n, gx, gy, gz), answer in zip(cases, answers):
        call = f"layer_volume(m={m}, k={k}, n={n}, gx={gx}, gy={gy}, gz={gz})"
        got = _value(ex, call, answer)
        want = references.expected_volume(m, k, n, gx, gy, gz)
        if not isinstance(got, numbers.Real):
            raise checks.CheckFailed(f"{ex}: layer_volume(...) must return a number of "
                                     f"elements, got {type(got).__name__} ({got!r})")
        if abs(got - want) > 1e-6 * max(1.0, want):
            raise checks.CheckFailed(
                f"{ex}: {call} = {got!r}, expected {want:,.2f} elements sent per GPU (forward "
                f"+ backward).\nHint: {messages.volume_hint(got, m, k, n, gx, gy, gz)}")
    return f"Megatron's column and row layers, 2D and 3D grids, {trials} random ones"


__all__ = ["check_split_matmul", "check_f_and_g", "check_parallel_mlp", "check_shard_qkv",
           "check_layer_volume", "check_tp_block", "LECTURE_X", "LECTURE_A", "dense_mlp",
           "EX_SPLIT", "EX_FG", "EX_MLP", "EX_HEADS", "EX_VOLUME", "EX_BLOCK",
           "check_all_reduce_count_prediction", "check_all_reduce_size_prediction"]
