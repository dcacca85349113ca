"""Checks of Lab 05's exercises: tensor parallelism, from a split matrix to a block.

5.1 (split a matrix product by hand) and 5.5 (communication volume of grids) are
checked in the notebook's process; 5.2 (f and g), 5.3 (a parallel MLP) and 5.4
(attention split by heads) run the student's code under torchrun on 2 and 3
ranks, and on a pair of ranks inside 3 (a group that is not the world), against
the dense computation done here. All-reduces are counted per direction by
wrapping ``torch.distributed.all_reduce`` on the ranks for the duration of the
check: calls made through that attribute (``dist.all_reduce(...)``, from the
student's code or course_lib's collectives) are counted, and a name imported
before the check (``from torch.distributed import all_reduce``) or another
collective API is not. The exercise text says so, and so does the message when
the values are right but nothing was counted.
"""
from __future__ import annotations

import numbers
import random
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.grading import checks
from course_lib.tp import volume

EX_SPLIT, EX_FG, EX_MLP, EX_HEADS, EX_VOLUME = (f"Exercise 5.{i}" for i in range(1, 6))
LECTURE_X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
LECTURE_A = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])


def _seeded(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), device="cpu")


# ---- 5.1: the lecture's matrix product, split by columns and by rows ---------------------
def check_split_matmul(column_parallel_matmul, row_parallel_matmul):
    ex = EX_SPLIT
    cases = [(LECTURE_X, LECTURE_A, 2, 3)]  # columns over 2 "GPUs", rows over 3
    rng = random.Random(5)
    for _ in range(6):
        t_col, t_row = rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
        m, k, n = rng.randint(1, 5), t_row * rng.randint(1, 3), t_col * rng.randint(1, 3)
        cases.append((_seeded(rng.randint(0, 999), m, k), _seeded(rng.randint(0, 999), k, n),
                      t_col, t_row))
    with checks.in_process(ex, column_parallel_matmul, row_parallel_matmul):
        for x, a, t_col, t_row in cases:
            shape = f"X {tuple(x.shape)}, A {tuple(a.shape)}"
            got = _as_list(ex, column_parallel_matmul(x, a, t_col), t_col, "column_parallel_matmul")
            for i, (block, a_i) in enumerate(zip(got, a.chunk(t_col, dim=1))):
                want = x @ a_i
                if block.shape != want.shape:
                    raise checks.CheckFailed(
                        f"{ex}: column_parallel_matmul({shape}, t={t_col}): GPU {i}'s block has "
                        f"shape {tuple(block.shape)}, expected {tuple(want.shape)}.\nHint: a "
                        f"column "
                        f"split gives GPU i the columns A_i of A = [A_1 ... A_t] and the whole X: "
                        f"Y_i = X A_i, shape (m, n/t).")
                checks.expect_close(ex, block, want, rank=i, world_size=t_col,
                                    what=f"column_parallel_matmul({shape}), block Y_{i + 1}",
                                    hint="Y_i = X @ A[:, columns of GPU i]")
            got = row_parallel_matmul(x, a, t_row)
            if _is_data_parallel(got, x, a):
                raise checks.CheckFailed(
                    f"{ex}: row_parallel_matmul({shape}, t={t_row}) split X's rows (the batch) "
                    f"and gave every GPU the whole A: that is data parallelism, not a split of "
                    f"the matrix.\nHint: give GPU i the rows A_i of A = [A_1; ...; A_t] and the "
                    f"matching columns X_i of X = [X_1 ... X_t]; XA = sum_i X_i A_i.")
            got = _as_list(ex, got, t_row, "row_parallel_matmul")
            parts = zip(x.chunk(t_row, dim=1), a.chunk(t_row, dim=0))
            for i, (block, (x_i, a_i)) in enumerate(zip(got, parts)):
                want = x_i @ a_i
                if block.shape != want.shape:
                    raise checks.CheckFailed(
                        f"{ex}: row_parallel_matmul({shape}, t={t_row}): GPU {i}'s partial product "
                        f"has shape {tuple(block.shape)}, expected {tuple(want.shape)}.\nHint: "
                        f"a row split gives GPU i the rows A_i of A = [A_1; ...; A_t] and the "
                        f"matching columns X_i of X = [X_1 ... X_t]: X_i A_i is (m, n), and "
                        f"XA = sum_i X_i A_i.")
                checks.expect_close(ex, block, want, rank=i, world_size=t_row,
                                    what=f"row_parallel_matmul({shape}), partial product {i + 1}",
                                    hint="X_i = X[:, block i of the columns], A_i = A[block i "
                                         "of the rows, :]")
    checks.passed(ex, f"the lecture's example and {len(cases) - 1} random shapes, by columns "
                      f"and by rows")


def _is_data_parallel(got, x, a):
    """Blocks of X's rows, each times the whole A (stacked, they are XA)."""
    if not isinstance(got, (list, tuple)) or len(got) < 2 or \
            not all(isinstance(g, torch.Tensor) and g.dim() == 2 for g in got):
        return False
    if any(g.shape[1] != a.shape[1] for g in got) or sum(g.shape[0] for g in got) != x.shape[0]:
        return False
    return torch.allclose(torch.cat(list(got)), x @ a, rtol=1e-5, atol=1e-5)


def _as_list(ex, got, t, name):
    if not isinstance(got, (list, tuple)) or len(got) != t:
        raise checks.CheckFailed(f"{ex}: {name} must return a list of t = {t} tensors, one per "
                                 f"GPU, got {type(got).__name__}"
                                 + (f" of length {len(got)}" if hasattr(got, "__len__") else ""))
    return list(got)


# ---- counting all-reduces on the ranks --------------------------------------------------
@contextmanager
def _all_reduces():
    """On a rank: every ``dist.all_reduce`` call inside the block, as element counts."""
    calls, original = [], dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield calls
    finally:
        dist.all_reduce = original


def _pair_group():
    """Ranks 0 and 1 as one group, rank 2 alone (every rank creates both)."""
    pair, alone = dist.new_group([0, 1]), dist.new_group([2])
    return pair if dist.get_rank() < 2 else alone


def _group_cases(world):
    return [("the world", False)] + ([("ranks {0, 1} of 3", True)] if world == 3 else [])


# ---- 5.2: f and g ---------------------------------------------------------------------
SHAPE = (3, 5, 4)


def _run_operator(op, calls, group, x_seed, weight_seed):
    """Apply the student's f or g to a fresh leaf, backward through it, and record
    (output, input gradient, all-reduces forward, all-reduces backward, the input
    as it is after forward, whether backward changed its incoming gradient)."""
    x = _seeded(x_seed, *SHAPE).requires_grad_()
    start = len(calls)
    y = op.apply(x, group)
    fwd = len(calls) - start
    x_after = x.detach().clone()
    incoming = []  # the gradient autograd hands to op's backward, and a copy of it
    if isinstance(y, torch.Tensor) and y.requires_grad:
        y.register_hook(lambda grad: incoming.append((grad, grad.detach().clone())))
    (y * _seeded(weight_seed, *SHAPE)).sum().backward()
    grad_changed = bool(incoming) and not torch.equal(*incoming[0])
    return y.detach().clone(), x.grad, fwd, len(calls) - start - fwd, x_after, grad_changed


def _fg_job(copy_to_tp, reduce_from_tp, use_pair):
    group = _pair_group() if use_pair else None
    rank = dist.get_rank()
    with _all_reduces() as calls:
        f = _run_operator(copy_to_tp, calls, group, 1, 100 + rank)
        g = _run_operator(reduce_from_tp, calls, group, 200 + rank, 2)
    return f, g


def _members(world, use_pair, rank):
    if not use_pair:
        return list(range(world))
    return [0, 1] if rank < 2 else [2]


def check_f_and_g(copy_to_tp, reduce_from_tp, world_sizes=(2, 3)):
    ex = EX_FG
    for n in world_sizes:
        for where, use_pair in _group_cases(n):
            outs = checks.launch(ex, _fg_job, copy_to_tp, reduce_from_tp, use_pair, nproc=n)
            for rank, (f, g) in enumerate(outs):
                members = _members(n, use_pair, rank)
                t = len(members)
                _grade_f(ex, f, rank, n, t, members, where)
                _grade_g(ex, g, rank, n, t, members, where)
    checks.passed(ex, f"world sizes {list(world_sizes)} and a group of 2 inside 3: values, "
                      f"input gradients, one all-reduce each, in the right direction")


def _not_counted(ex, rank, where, what):
    """The values are right but no dist.all_reduce was counted: the student called
    the collective some other way."""
    return checks.CheckFailed(
        f"{ex}: rank {rank}, group = {where}: {what} right, but the check saw no call to "
        f"dist.all_reduce.\nHint: the check counts calls to dist.all_reduce; call it as "
        f"dist.all_reduce(tensor, group=group), with dist the module torch.distributed "
        f"(`import torch.distributed as dist`). An all_reduce imported by name (`from "
        f"torch.distributed import all_reduce`) or another collective API is not counted.")


def _close(got, want):
    return isinstance(got, torch.Tensor) and got.shape == want.shape and \
        got.dtype == want.dtype and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def _grade_f(ex, f, rank, n, t, members, where):
    y, dx, fwd, bwd, x_after, grad_changed = f
    say = dict(rank=rank, world_size=n)
    x_in = _seeded(1, *SHAPE)
    want = sum(_seeded(100 + r, *SHAPE) for r in members)
    if fwd:
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: f (CopyToTP) ran {fwd} all-reduce(s) in forward."
            f"\nHint: f is the identity forward (every rank already holds the whole X) and "
            f"all-reduces in backward; g is the other way round. Did you swap f and g?")
    if t > 1 and bwd == 0 and _close(y, x_in) and _close(dx, want):
        raise _not_counted(ex, rank, where, "f's output and the gradient it gives X are")
    if t > 1 and bwd != 1:
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: f's backward ran {bwd} all-reduce(s), "
            f"expected exactly 1.\nHint: every rank used the whole X for its own part of the "
            f"layer, so dL/dX = sum over ranks of dL/dY_i: all-reduce the gradient, once.")
    if not torch.equal(x_after, x_in):
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: f changed its input X in place in forward."
            f"\nHint: f's forward returns X as it is (x.view_as(x)) and touches nothing.")
    if grad_changed:
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: f's backward changed the incoming gradient in "
            f"place.\nHint: all-reduce a copy (grad = grad.clone(), then dist.all_reduce(grad, "
            f"group=ctx.group)) and return it. Autograd may hand the same gradient tensor to "
            f"other functions as well: after an addition, both branches get the same tensor.")
    checks.expect_close(ex, y, x_in, **say, what=f"f's output (group = {where})",
                        hint="f's forward returns X unchanged")
    checks.expect_close(ex, dx, want, **say, rtol=1e-5, atol=1e-5,
                        what=f"the gradient f gives X (group = {where})",
                        hint="all-reduce (SUM) the incoming gradient over the group you were "
                             "given: dist.all_reduce(grad, group=group)")


def _grade_g(ex, g, rank, n, t, members, where):
    y, dx, fwd, bwd, x_after, grad_changed = g
    say = dict(rank=rank, world_size=n)
    x_in, dy = _seeded(200 + rank, *SHAPE), _seeded(2, *SHAPE)
    want = sum(_seeded(200 + r, *SHAPE) for r in members)
    if bwd:
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: g (ReduceFromTP)'s backward ran {bwd} "
            f"all-reduce(s).\nHint: Y = sum_i X_i, so dL/dX_i = dL/dY, the same on every rank "
            f"already: g's backward is the identity (all-reducing it counts the gradient t times).")
    if t > 1 and fwd == 0 and _close(y, want) and _close(dx, dy):
        raise _not_counted(ex, rank, where, "g's output and the gradient it gives its input are")
    if t > 1 and fwd != 1:
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: g's forward ran {fwd} all-reduce(s), expected "
            f"exactly 1.\nHint: each rank holds a partial sum X_i; g's forward returns their "
            f"sum, one all-reduce.")
    if not torch.equal(x_after, x_in):
        now = "holds the all-reduced sum" if _close(x_after, want) else "differs from the input"
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: g changed its input X in place: after g's "
            f"forward, X {now}.\nHint: all-reduce a copy (out = x.clone(), then "
            f"dist.all_reduce(out, group=group)) and return the copy. X belongs to the caller: "
            f"other code may still read it, and autograd may have saved it for backward.")
    if grad_changed:
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: g's backward changed the incoming gradient in "
            f"place.\nHint: g's backward returns the incoming gradient as it is.")
    checks.expect_close(ex, y, want, **say, rtol=1e-5, atol=1e-5,
                        what=f"g's output (group = {where})",
                        hint="all-reduce a copy of X over the group you were given (do not "
                             "modify the input in place)")
    checks.expect_close(ex, dx, dy, **say,
                        what=f"the gradient g gives its input (group = {where})",
                        hint="g's backward returns the incoming gradient as it is")


# ---- 5.3: a parallel MLP --------------------------------------------------------------
H, HIDDEN = 6, 24  # the hidden width splits by 2 and 3
SHARDS = {"w1": ("the first layer's weight", 0), "b1": ("the first layer's bias", 0),
          "w2": ("the second layer's weight", 1), "b2": ("the second layer's bias", None)}


def dense_mlp(seed=7):
    """nn.Sequential(Linear(6, 24), GELU, Linear(24, 6)) with random (non-zero) biases."""
    gen = torch.Generator().manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(H, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, H))
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * 0.5)
    return mlp


def _mlp_job(mlp_class, use_pair):
    group = _pair_group() if use_pair else None
    module = mlp_class(dense_mlp(), group)
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    x = _seeded(8, 3, 5, H).requires_grad_()
    try:
        with _all_reduces() as calls:
            y = module(x)
            fwd = len(calls)
            (y * _seeded(9, 3, 5, H)).sum().backward()
    except Exception as exc:  # noqa: BLE001 - graded below, with the shapes at hand
        return params, None, f"{type(exc).__name__}: {exc}"
    grads = {name: p.grad for name, p in module.named_parameters()}
    return params, (y.detach(), x.grad, grads, fwd, len(calls) - fwd), None


def _dense_reference():
    mlp = dense_mlp()
    x = _seeded(8, 3, 5, H).requires_grad_()
    y = mlp(x)
    (y * _seeded(9, 3, 5, H)).sum().backward()
    full = {"w1": mlp[0].weight, "b1": mlp[0].bias, "w2": mlp[2].weight, "b2": mlp[2].bias}
    return y.detach(), x.grad, {k: v.detach() for k, v in full.items()}, \
        {k: v.grad for k, v in full.items()}


def _slice(full, dim, r, t):
    return full if dim is None else full.chunk(t, dim=dim)[r]


def check_parallel_mlp(mlp_class, world_sizes=(2, 3)):
    ex = EX_MLP
    y_want, dx_want, full, grads = _dense_reference()
    for n in world_sizes:
        for where, use_pair in _group_cases(n):
            outs = checks.launch(ex, _mlp_job, mlp_class, use_pair, nproc=n)
            for rank, (params, result, error) in enumerate(outs):
                members = _members(n, use_pair, rank)
                t, me = len(members), members.index(rank)
                _grade_mlp(ex, params, result, error, rank, n, t, me, where,
                           y_want, dx_want, full, grads)
    checks.passed(ex, f"world sizes {list(world_sizes)} and a group of 2 inside 3: each rank's "
                      f"slices, output, every gradient, one all-reduce each way")


def _parameter_names_message(ex, rank, names):
    missing = [k for k in SHARDS if k not in names]
    unexpected = [k for k in names if k not in SHARDS]
    parts = []
    if missing:
        parts.append("missing parameter(s) " + ", ".join(f"{k} ({SHARDS[k][0]})" for k in missing))
    if unexpected:
        parts.append("unexpected parameter(s) " + ", ".join(unexpected))
    hint = ("Hint: __init__ creates exactly four nn.Parameter attributes: self.w1, self.b1 "
            "and self.w2, this rank's slices (dense_param.chunk(t, dim)[r]), and self.b2, all "
            "of the second layer's bias. A plain tensor attribute is not a parameter")
    if any("." in k for k in unexpected):
        hint += (". Keep no submodule that holds parameters (not the dense mlp, no nn.Linear): "
                 "their parameters count as this module's too")
    return (f"{ex}: rank {rank}: your module's parameters are {names or 'none'}: "
            f"{'; '.join(parts)}.\n{hint}.")


def _grade_mlp(ex, params, result, error, rank, n, t, me, where, y_want, dx_want, full, grads):
    say = dict(rank=rank, world_size=n)
    if set(params) != set(SHARDS):
        raise checks.CheckFailed(_parameter_names_message(ex, rank, sorted(params)))
    for name, (what, dim) in SHARDS.items():
        want = _slice(full[name], dim, me, t)
        if params[name].shape != want.shape:
            split = {0: "its rows (nn.Linear's weight is (out, in): a column split of A is a "
                        "split of the output features)",
                     1: "its columns (a row split of A is a split of the input features)",
                     None: "nothing: the second layer's bias is whole on every rank"}[dim]
            raise checks.CheckFailed(
                f"{ex}: rank {rank} (group = {where}, t = {t}): {name}, {what}, has shape "
                f"{tuple(params[name].shape)}, expected {tuple(want.shape)}.\nHint: split {split}.")
        checks.expect_close(ex, params[name], want, **say, what=f"{name} ({what}) on this rank",
                            hint=f"take slice {me} of {t} of the dense parameter")
    if error is not None:
        raise checks.CheckFailed(f"{ex}: rank {rank} (group = {where}): forward or backward "
                                 f"raised {error}")
    y, dx, got_grads, fwd, bwd = result
    if t > 1 and (fwd, bwd) == (0, 0) and _close(y, y_want) and _close(dx, dx_want):
        raise _not_counted(ex, rank, where, "the MLP's output and input gradient are")
    if t > 1 and (fwd, bwd) != (1, 1):
        missing = ("X goes through f (CopyToTP) before the first layer: its backward is the "
                   "all-reduce of X's gradient. " if bwd == 0 else "") + \
                  ("The second layer's partial output goes through g (ReduceFromTP): its "
                   "forward is the all-reduce. " if fwd == 0 else "")
        raise checks.CheckFailed(
            f"{ex}: rank {rank} (group = {where}): {fwd} all-reduce(s) forward and {bwd} "
            f"backward; a column-then-row pair needs exactly 1 and 1.\nHint: {missing}f on the "
            f"input, g on the second layer's partial output, nothing else.")
    extra_bias = y_want + (t - 1) * full["b2"]
    if t > 1 and torch.allclose(y, extra_bias, rtol=1e-5, atol=1e-5):
        raise checks.CheckFailed(
            f"{ex}: rank {rank} (group = {where}): the output is the dense output plus "
            f"{t - 1} x b2.\nHint: every rank added b2 before the all-reduce, so the sum counts "
            f"it t times. Add the row-parallel layer's bias once, after g.")
    checks.expect_close(ex, y, y_want, **say, rtol=1e-5, atol=1e-5, what="the MLP's output",
                        hint="Y = g(GELU(f(X) A_r + a_r) B_r) + b")
    checks.expect_close(ex, dx, dx_want, **say, rtol=1e-5, atol=1e-5,
                        what="the gradient of the MLP's input X",
                        hint="X's gradient must be summed over the ranks: X goes through f "
                             "(CopyToTP) before the first layer")
    for name, (what, dim) in SHARDS.items():
        checks.expect_close(ex, got_grads[name], _slice(grads[name], dim, me, t), **say,
                            rtol=1e-5, atol=1e-5, what=f"the gradient of {name} ({what})")


# ---- 5.4: attention split by heads ------------------------------------------------------
def _qkv_cases():
    return [(6, 1), (6, 2), (6, 3), (4, 2), (4, 4), (2, 2)]


def _expected_qkv(weight, heads, rank, t):
    return torch.cat([part.chunk(t, dim=0)[rank] for part in weight.chunk(3, dim=0)])


def _heads_job(shard_qkv, use_pair):
    from course_lib.models import CausalSelfAttention, GPTConfig
    from course_lib.tp import ParallelAttention

    group = _pair_group() if use_pair else None
    t, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(11)
    attn = CausalSelfAttention(GPTConfig(dim=12, heads=6))
    parallel = ParallelAttention.from_dense(attn, group)
    with torch.no_grad():  # the course's layer, with the student's slice of q/k/v
        parallel.qkv.weight.copy_(shard_qkv(attn.qkv.weight.detach(), 6, r, t))
    x = _seeded(12, 3, 5, 12).requires_grad_()
    y = parallel(x)
    (y * _seeded(13, 3, 5, 12)).sum().backward()
    return y.detach(), x.grad


def check_shard_qkv(shard_qkv, world_sizes=(2, 3)):
    ex = EX_HEADS
    with checks.in_process(ex, shard_qkv):
        for heads, t in _qkv_cases():
            dim = 2 * heads
            weight = _seeded(heads * 10 + t, 3 * dim, dim)
            for rank in range(t):
                got = shard_qkv(weight, heads, rank, t)
                want = _expected_qkv(weight, heads, rank, t)
                what = f"shard_qkv(weight {tuple(weight.shape)}, heads={heads}, rank={rank}, t={t})"
                if isinstance(got, torch.Tensor) and got.shape == want.shape and t > 1 \
                        and torch.equal(got, weight.chunk(t, dim=0)[rank]):
                    raise checks.CheckFailed(
                        f"{ex}: {what} is a contiguous 1/{t} of the fused weight.\nHint: the "
                        f"fused weight stacks q, k and v; a contiguous slice gives rank 0 all of "
                        f"q's rows and none of v's. Take this rank's heads' rows of *each* of "
                        f"q, k and v, and stack those three.")
                checks.expect_close(ex, got, want, rank=rank, world_size=t, what=what,
                                    hint="rows [r*h/t, (r+1)*h/t) of q, of k and of v, in that "
                                         "order (h = the model width)")
        try:
            shard_qkv(torch.zeros(12, 4), 4, 0, 3)
        except ValueError as exc:
            if "4" not in str(exc) or "3" not in str(exc):
                raise checks.CheckFailed(f"{ex}: the ValueError for heads=4, t=3 says {exc!r}; "
                                         f"name both numbers") from None
        else:
            raise checks.CheckFailed(f"{ex}: shard_qkv(weight, heads=4, rank=0, t=3) returned; "
                                     f"expected a ValueError: 4 heads do not split over 3 ranks")
    y_want, dx_want = _dense_heads()
    for n in world_sizes:
        for where, use_pair in _group_cases(n):
            outs = checks.launch(ex, _heads_job, shard_qkv, use_pair, nproc=n)
            for rank, (y, dx) in enumerate(outs):
                for got, want, what in ((y, y_want, "output"), (dx, dx_want, "input gradient")):
                    checks.expect_close(ex, got, want, rank=rank, world_size=n, rtol=1e-5,
                                        atol=1e-5, what=f"the attention's {what} with your "
                                                        f"slices (group = {where})")
    checks.passed(ex, f"{len(_qkv_cases())} head/rank layouts, the ValueError, and attention "
                      f"equal to dense on world sizes {list(world_sizes)}")


def _dense_heads():
    from course_lib.models import CausalSelfAttention, GPTConfig

    torch.manual_seed(11)
    attn = CausalSelfAttention(GPTConfig(dim=12, heads=6))
    x = _seeded(12, 3, 5, 12).requires_grad_()
    y = attn(x)
    (y * _seeded(13, 3, 5, 12)).sum().backward()
    return y.detach(), x.grad


# ---- 5.5: communication volume on 1D, 2D and 3D grids ------------------------------------
def _no_ring_factors(m, k, n, gx, gy, gz):
    block = k * n / (gx * gy)
    return ((block if gz > 1 else 0) + (2 * m / gz * n / gy if gx > 1 else 0)
            + (2 * m / gz * k / gx if gy > 1 else 0) + (block if gz > 1 else 0))


def _volume_hint(got, m, k, n, gx, gy, gz):
    parts = volume.grid_volume(m, k, n, gx, gy, gz)
    weights = 2 * volume.gather_sent(k * n / (gx * gy), gz)

    def near(a):
        return abs(got - a) <= 1e-6 * max(1.0, abs(a))

    if gz > 1 and near(parts["total"] + weights / 2):
        return "the gathered weight block is kept from forward to backward: one all-gather " \
               "per step, in forward; backward only reduce-scatters dA (FSDP in Lab 03 " \
               "gathers again in backward; this model does not)"
    if gz > 1 and near(parts["total"] - weights):
        return "with gz > 1 the weight block is sharded over gz: all-gather it before " \
               "forward ((gz-1)/gz of it) and reduce-scatter its gradient in backward"
    if near(parts["forward"]):
        return "that is the forward pass only: add backward (dX all-reduced over gy, dA " \
               "reduce-scattered over gz)"
    if near(_no_ring_factors(m, k, n, gx, gy, gz)):
        return "a ring all-reduce of S elements sends 2(p-1)/p S per rank, an all-gather or " \
               "reduce-scatter (p-1)/p S: include the (p-1)/p"
    return "forward: all-gather A's block (k/gx, n/gy) over gz, all-reduce Y's block " \
           "(m/gz, n/gy) over gx; backward: all-reduce dX's block (m/gz, k/gx) over gy, " \
           "reduce-scatter dA over gz"


def check_layer_volume(layer_volume, trials=60):
    ex = EX_VOLUME
    rng = random.Random(9)
    cases = [(4096, 8192, 8192, 1, 4, 1), (4096, 8192, 8192, 4, 1, 1),  # Megatron column, row
             (4096, 8192, 8192, 2, 2, 1), (4096, 8192, 8192, 2, 2, 2), (10, 6, 12, 1, 1, 1)]
    cases += [(rng.randint(1, 512), rng.randint(1, 256), rng.randint(1, 256), rng.randint(1, 8),
               rng.randint(1, 8), rng.randint(1, 8)) for _ in range(trials)]
    with checks.in_process(ex, layer_volume):
        for m, k, n, gx, gy, gz in cases:
            got = layer_volume(m, k, n, gx, gy, gz)
            want = volume.grid_volume(m, k, n, gx, gy, gz)["total"]
            if not isinstance(got, numbers.Real):
                raise checks.CheckFailed(f"{ex}: layer_volume(...) must return a number of "
                                         f"elements, got {type(got).__name__} ({got!r})")
            if abs(got - want) > 1e-6 * max(1.0, want):
                raise checks.CheckFailed(
                    f"{ex}: layer_volume(m={m}, k={k}, n={n}, gx={gx}, gy={gy}, gz={gz}) = "
                    f"{got!r}, expected {want:,.2f} elements sent per GPU (forward + backward)."
                    f"\nHint: {_volume_hint(got, m, k, n, gx, gy, gz)}")
    checks.passed(ex, f"Megatron's column and row layers, 2D and 3D grids, {trials} random ones")
