"""Lab 05's diagnoses: what a student reads when an answer is wrong, and the hint.

Each function takes what the student's code gave (plain data) and what
:mod:`.references` expects, and raises :class:`~course_lib.grading.checks.CheckFailed`
naming the likely mistake, the most telling one first.
"""
from __future__ import annotations

import torch

from course_lib.grading import checks
from course_lib.grading.lab05.references import SHARDS
from course_lib.tp.volume import gather_sent, grid_volume


def raised(ex, call, answer):
    return checks.CheckFailed(f"{ex}: {call} raised {answer['raised']}: {answer['message']}")


def close(got, want):
    return isinstance(got, torch.Tensor) and got.shape == want.shape and \
        got.dtype == want.dtype and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


# ---- 5.1 ------------------------------------------------------------------------------------
def as_list(ex, got, t, name):
    if not isinstance(got, (list, tuple)) or len(got) != t:
        raise checks.CheckFailed(f"{ex}: {name} must return a list of t = {t} tensors, one per "
                                 f"GPU, got {type(got).__name__}"
                                 + (f" of length {len(got)}" if hasattr(got, "__len__") else ""))
    return list(got)


def column_block_shape(ex, shape, t, i, block, want):
    return checks.CheckFailed(
        f"{ex}: column_parallel_matmul({shape}, t={t}): GPU {i}'s block has shape "
        f"{tuple(block.shape)}, expected {tuple(want.shape)}.\nHint: a column split gives GPU i "
        f"the columns A_i of A = [A_1 ... A_t] and the whole X: Y_i = X A_i, shape (m, n/t).")


def row_block_shape(ex, shape, t, i, block, want):
    return checks.CheckFailed(
        f"{ex}: row_parallel_matmul({shape}, t={t}): GPU {i}'s partial product has shape "
        f"{tuple(block.shape)}, expected {tuple(want.shape)}.\nHint: a row split gives GPU i the "
        f"rows A_i of A = [A_1; ...; A_t] and the matching columns X_i of X = [X_1 ... X_t]: "
        f"X_i A_i is (m, n), and XA = sum_i X_i A_i.")


def is_data_parallel(got, x, a):
    """Blocks of X's rows, each times the whole A (stacked, they are XA)."""
    if not isinstance(got, (list, tuple)) or len(got) < 2 or \
            not all(isinstance(g, torch.Tensor) and g.dim() == 2 for g in got):
        return False
    if any(g.shape[1] != a.shape[1] for g in got) or sum(g.shape[0] for g in got) != x.shape[0]:
        return False
    return torch.allclose(torch.cat(list(got)), x @ a, rtol=1e-5, atol=1e-5)


def data_parallel(ex, shape, t):
    return checks.CheckFailed(
        f"{ex}: row_parallel_matmul({shape}, t={t}) split X's rows (the batch) and gave every "
        f"GPU the whole A: that is data parallelism, not a split of the matrix.\nHint: give GPU "
        f"i the rows A_i of A = [A_1; ...; A_t] and the matching columns X_i of X = "
        f"[X_1 ... X_t]; XA = sum_i X_i A_i.")


# ---- 5.2 ------------------------------------------------------------------------------------
def not_counted(ex, rank, where, what):
    """The values are right but no dist.all_reduce was counted: the student called
    the collective some other way."""
    return checks.CheckFailed(
        f"{ex}: rank {rank}, group = {where}: {what} right, but the check saw no call to "
        f"dist.all_reduce.\nHint: the check counts calls to dist.all_reduce; call it as "
        f"dist.all_reduce(tensor, group=group), with dist the module torch.distributed "
        f"(`import torch.distributed as dist`). An all_reduce imported by name (`from "
        f"torch.distributed import all_reduce`) or another collective API is not counted.")


def _grad_changed(got):
    return got["incoming"] is not None and not torch.equal(*got["incoming"])


def grade_f(ex, f, rank, n, t, where, x_in, want):
    """f: the identity forward, an all-reduce of the gradient backward."""
    say = dict(rank=rank, world_size=n)
    if f["fwd"]:
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: f (CopyToTP) ran {f['fwd']} all-reduce(s) in "
            f"forward.\nHint: f is the identity forward (every rank already holds the whole X) "
            f"and all-reduces in backward; g is the other way round. Did you swap f and g?")
    if t > 1 and f["bwd"] == 0 and close(f["y"], x_in) and close(f["dx"], want):
        raise not_counted(ex, rank, where, "f's output and the gradient it gives X are")
    if t > 1 and f["bwd"] != 1:
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: f's backward ran {f['bwd']} all-reduce(s), "
            f"expected exactly 1.\nHint: every rank used the whole X for its own part of the "
            f"layer, so dL/dX = sum over ranks of dL/dY_i: all-reduce the gradient, once.")
    if not torch.equal(f["x_after"], x_in):
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: f changed its input X in place in forward."
            f"\nHint: f's forward returns X as it is (x.view_as(x)) and touches nothing.")
    if _grad_changed(f):
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: f's backward changed the incoming gradient in "
            f"place.\nHint: all-reduce a copy (grad = grad.clone(), then dist.all_reduce(grad, "
            f"group=ctx.group)) and return it. Autograd may hand the same gradient tensor to "
            f"other functions as well: after an addition, both branches get the same tensor.")
    checks.expect_close(ex, f["y"], x_in, **say, what=f"f's output (group = {where})",
                        hint="f's forward returns X unchanged")
    checks.expect_close(ex, f["dx"], want, **say, rtol=1e-5, atol=1e-5,
                        what=f"the gradient f gives X (group = {where})",
                        hint="all-reduce (SUM) the incoming gradient over the group you were "
                             "given: dist.all_reduce(grad, group=group)")


def grade_g(ex, g, rank, n, t, where, x_in, want, dy):
    """g: an all-reduce forward, the identity backward."""
    say = dict(rank=rank, world_size=n)
    if g["bwd"]:
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: g (ReduceFromTP)'s backward ran {g['bwd']} "
            f"all-reduce(s).\nHint: Y = sum_i X_i, so dL/dX_i = dL/dY, the same on every rank "
            f"already: g's backward is the identity (all-reducing it counts the gradient t times).")
    if t > 1 and g["fwd"] == 0 and close(g["y"], want) and close(g["dx"], dy):
        raise not_counted(ex, rank, where, "g's output and the gradient it gives its input are")
    if t > 1 and g["fwd"] != 1:
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: g's forward ran {g['fwd']} all-reduce(s), "
            f"expected exactly 1.\nHint: each rank holds a partial sum X_i; g's forward returns "
            f"their sum, one all-reduce.")
    if not torch.equal(g["x_after"], x_in):
        now = "holds the all-reduced sum" if close(g["x_after"], want) else "differs from the input"
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: g changed its input X in place: after g's "
            f"forward, X {now}.\nHint: all-reduce a copy (out = x.clone(), then "
            f"dist.all_reduce(out, group=group)) and return the copy. X belongs to the caller: "
            f"other code may still read it, and autograd may have saved it for backward.")
    if _grad_changed(g):
        raise checks.CheckFailed(
            f"{ex}: rank {rank}, group = {where}: g's backward changed the incoming gradient in "
            f"place.\nHint: g's backward returns the incoming gradient as it is.")
    checks.expect_close(ex, g["y"], want, **say, rtol=1e-5, atol=1e-5,
                        what=f"g's output (group = {where})",
                        hint="all-reduce a copy of X over the group you were given (do not "
                             "modify the input in place)")
    checks.expect_close(ex, g["dx"], dy, **say,
                        what=f"the gradient g gives its input (group = {where})",
                        hint="g's backward returns the incoming gradient as it is")


# ---- 5.3 ------------------------------------------------------------------------------------
def parameter_names(ex, rank, names):
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
    return checks.CheckFailed(f"{ex}: rank {rank}: your module's parameters are "
                              f"{names or 'none'}: {'; '.join(parts)}.\n{hint}.")


def shard_shape(ex, rank, where, t, name, what, dim, got, want):
    split = {0: "its rows (nn.Linear's weight is (out, in): a column split of A is a "
                "split of the output features)",
             1: "its columns (a row split of A is a split of the input features)",
             None: "nothing: the second layer's bias is whole on every rank"}[dim]
    return checks.CheckFailed(
        f"{ex}: rank {rank} (group = {where}, t = {t}): {name}, {what}, has shape "
        f"{tuple(got.shape)}, expected {tuple(want.shape)}.\nHint: split {split}.")


def all_reduce_count(ex, rank, where, fwd, bwd):
    missing = ("X goes through f (CopyToTP) before the first layer: its backward is the "
               "all-reduce of X's gradient. " if bwd == 0 else "") + \
              ("The second layer's partial output goes through g (ReduceFromTP): its "
               "forward is the all-reduce. " if fwd == 0 else "")
    return checks.CheckFailed(
        f"{ex}: rank {rank} (group = {where}): {fwd} all-reduce(s) forward and {bwd} "
        f"backward; a column-then-row pair needs exactly 1 and 1.\nHint: {missing}f on the "
        f"input, g on the second layer's partial output, nothing else.")


def bias_on_every_rank(ex, rank, where, t):
    return checks.CheckFailed(
        f"{ex}: rank {rank} (group = {where}): the output is the dense output plus "
        f"{t - 1} x b2.\nHint: every rank added b2 before the all-reduce, so the sum counts "
        f"it t times. Add the row-parallel layer's bias once, after g.")


# ---- 5.4 ------------------------------------------------------------------------------------
def contiguous_qkv(ex, what, t):
    return checks.CheckFailed(
        f"{ex}: {what} is a contiguous 1/{t} of the fused weight.\nHint: the fused weight stacks "
        f"q, k and v; a contiguous slice gives rank 0 all of q's rows and none of v's. Take this "
        f"rank's heads' rows of *each* of q, k and v, and stack those three.")


# ---- 5.5 ------------------------------------------------------------------------------------
def _no_ring_factors(m, k, n, gx, gy, gz):
    block = k * n / (gx * gy)
    return ((block if gz > 1 else 0) + (2 * m / gz * n / gy if gx > 1 else 0)
            + (2 * m / gz * k / gx if gy > 1 else 0) + (block if gz > 1 else 0))


def volume_hint(got, m, k, n, gx, gy, gz):
    parts = grid_volume(m, k, n, gx, gy, gz)
    weights = 2 * gather_sent(k * n / (gx * gy), gz)

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
