"""Exercise 5.6: a tensor-parallel transformer block, from a blank page.

The student's class is a drop-in for the course GPT's ``Block``: ``cls(block, group)``
cuts a dense block, ``module(x)`` maps (b, s, h) to (b, s, h). It is graded as the
library's own :class:`~course_lib.tp.ParallelBlock` passes, on real gloo ranks (2, 3,
and a pair inside 3):

1. its parameters, found by their values (:func:`.block_references.match`): every one
   is this rank's slice of a dense parameter, and every dense parameter has its slice;
2. exactly 2 all-reduces forward (the two g's) and 2 backward (the two f's), counted
   as in 5.2;
3. the output, X's gradient and every parameter's gradient equal to the dense block's,
   sliced;
4. on 3 ranks, 4 heads refused with a ValueError;
5. the tiny GPT built from the student's blocks, trained with AdamW for a few steps:
   each loss and every final weight equal to the dense GPT's, trained in one process.

The usual wrong blocks get their own message: g missing after a row-parallel layer,
a bias or the residual added before g, f before the LayerNorm (the LayerNorms'
gradients are then partial sums), a sharded LayerNorm.
"""
from __future__ import annotations

import torch

from course_lib.grading import checks, salt
from course_lib.grading.lab05 import block_references as refs
from course_lib.grading.lab05 import jobs, messages
from course_lib.grading.lab05.references import group_cases, members
from course_lib.grading.requests import on_ranks
from course_lib.tp.training import gpt_config, train_gpt

EX_BLOCK = "Exercise 5.6"
STEPS = 3
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@checks.check(EX_BLOCK, hidden=salt.draw)
def check_tp_block(block_class, world_sizes=(2, 3)):
    ex = EX_BLOCK
    want = refs.dense_block_reference()
    dense_gpt = train_gpt(gpt_config(), steps=STEPS, distinct=True, keep_state=True)
    for n in world_sizes:
        for where, use_pair in group_cases(n):
            outs = yield on_ranks(jobs.block_job, block_class, use_pair, STEPS,
                                  refusal=n == 3 and not use_pair, nproc=n)
            groups = [members(n, use_pair, rank) for rank in range(n)]
            found = [_grade_block(ex, out["block"], rank, n, groups[rank], where, want)
                     for rank, out in enumerate(outs)]
            _grade_gradients(ex, outs, found, groups, where, want)
            for rank, out in enumerate(outs):
                if out["refusal"] is not None:
                    _grade_refusal(ex, out["refusal"], rank, len(groups[rank]))
                _grade_training(ex, out["train"], rank, n, groups[rank], where, dense_gpt)
    return (f"world sizes {list(world_sizes)} and a group of 2 inside 3: each rank's slices, "
            f"output and every gradient equal to dense, 2 all-reduces each way, 4 heads "
            f"refused on 3 ranks, and {STEPS} AdamW steps of the GPT equal to dense")


def _at(ex, rank, where):
    return f"{ex}: rank {rank} (group = {where})"


# ---- the block alone ---------------------------------------------------------------------
def _grade_block(ex, got, rank, n, group, where, want):
    """Parameters, all-reduces, output and X's gradient on one rank; returns the match
    {student name: (dense name, part)} of its parameters."""
    y_want, dx_want, full, _ = want
    t, me, at = len(group), group.index(rank), _at(ex, rank, where)
    if "params" not in got:
        raise checks.CheckFailed(f"{at}: {got['error']}")
    found = _grade_parameters(at, got["params"], full, me, t, "the dense block")
    if got["error"] is not None:
        raise checks.CheckFailed(f"{at}: {got['error']}")
    y, dx, fwd, bwd = got["y"], got["dx"], got["fwd"], got["bwd"]
    if t > 1 and (fwd, bwd) == (0, 0) and messages.close(y, y_want) \
            and messages.close(dx, dx_want):
        raise messages.not_counted(ex, rank, where, "the block's output and input gradient are")
    if not messages.close(y, y_want):
        _name_the_mistake(at, y, me, t)
    if t > 1 and fwd != 2:
        raise checks.CheckFailed(
            f"{at}: your block made {fwd} all-reduce(s) in forward; a block makes exactly 2, "
            f"its two g's.\nHint: the attention's output projection and the MLP's second "
            f"layer are row parallel: each leaves a partial sum on every rank, and g "
            f"(ReduceFromTP) adds them up. Nothing else communicates in forward: f is the "
            f"identity there, and the LayerNorms and residual additions are replicated.")
    if t > 1 and bwd != 2:
        raise checks.CheckFailed(
            f"{at}: your block made {bwd} all-reduce(s) in backward; a block makes exactly 2, "
            f"its two f's.\nHint: f (CopyToTP) goes right before each column-parallel layer "
            f"(the q/k/v projection, the MLP's first layer), and its backward sums that "
            f"input's gradient over the group; g's backward is the identity.")
    checks.expect_close(ex, y, y_want, rank=rank, world_size=n, **TOLERANCE,
                        what=f"the block's output (group = {where})",
                        hint="x + g(attention(f(LN_1(x)))) + bias, then the same with the MLP "
                             "and LN_2")
    checks.expect_close(ex, dx, dx_want, rank=rank, world_size=n, **TOLERANCE,
                        what=f"the gradient of the block's input X (group = {where})",
                        hint="f wraps the input of each column-parallel layer only (after its "
                             "LayerNorm), never the residual stream: X's gradient from the "
                             "residual path is the same on every rank already, and summing it "
                             "over the group counts it t times")
    return found


def _name_the_mistake(at, y, me, t):
    """Raise the message of the first usual mistake that gives exactly ``y``, if any."""
    block, (x, _) = refs.dense_block(), refs.block_input()
    for branch, layer in (("attention", "output projection"), ("MLP", "second layer")):
        for mistake in refs.MISTAKES:
            if t == 1 or not messages.close(y, refs.rank_output(block, x.detach(), me, t,
                                                                 mistake, branch)):
                continue
            raise checks.CheckFailed(f"{at}: {_MISTAKE[mistake].format(b=branch, l=layer, t=t)}")


_MISTAKE = {
    "no g": "the {b}'s contribution to the output is this rank's partial sum alone: g is "
            "missing after the {b}'s {l}.\nHint: the {l} is row parallel, so each rank holds "
            "a partial sum; g (ReduceFromTP) adds them up over the group, then comes the bias, "
            "then the residual.",
    "bias before g": "the output has the {b}'s bias in it {t} times.\nHint: every rank added "
                     "the {l}'s bias before g, which summed it t times. Add it once, after g.",
    "residual before g": "the output counts the {b}'s input {t} times: the residual was added "
                         "to a partial sum before g.\nHint: g first (the {b}'s whole output, "
                         "then its bias), and only then x + that; every rank holds all of x "
                         "already.",
}


def _grade_parameters(at, params, full, me, t, dense_name):
    found, strays, uncovered, doubles = refs.match(params, full, me, t)
    if strays:
        name = strays[0]
        raise checks.CheckFailed(f"{at}: {_stray(name, params[name], full, me, t, dense_name)}")
    if doubles:
        first, second = doubles[0]
        raise checks.CheckFailed(
            f"{at}: parameters {first} and {second} hold the same slice of {found[first][0]}."
            f"\nHint: keep one; neither the dense block nor its layers should stay submodules "
            f"of yours (their parameters count as your block's).")
    if uncovered:
        name = uncovered[0]
        raise checks.CheckFailed(
            f"{at}: no parameter holds this rank's slice of {dense_name}'s {name} (rank r keeps "
            f"{refs.HOW[refs.layout(name)]}).\nHint: keep it as an nn.Parameter (a copy, "
            f"`nn.Parameter(piece.detach().clone())`): a plain tensor attribute is not a "
            f"parameter, so it is neither found here nor trained.")
    return found


def _stray(name, value, full, me, t, dense_name):
    what = refs.identify(value, full, me, t)
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else "?"
    if what is None:
        return (f"your parameter {name} {shape} is no slice of {dense_name}'s parameters.\n"
                f"Hint: each parameter must be a copy of this rank's slice of one dense "
                f"parameter, cut as in Exercises 5.3 and 5.4, with nn.Linear's (out, in) "
                f"orientation; the check finds it by its values.")
    kind, dense = what[0], what[1]
    how = refs.layout(dense)
    if kind == "whole":
        return (f"your parameter {name} holds all of {dense}; rank {me} of {t} keeps only "
                f"{refs.HOW[how]}.\nHint: neither the dense block nor its layers should stay "
                f"submodules of yours (their parameters count as your block's).")
    if kind == "transposed":
        return (f"your parameter {name} is this rank's slice of {dense}, transposed.\nHint: "
                f"keep nn.Linear's (out, in) orientation and compute with F.linear.")
    dim, chunk = what[2], what[3]
    if how is None and ".ln" in f".{dense}":
        return (f"your parameter {name} is a 1/{t} slice of {dense}: a LayerNorm is not split."
                f"\nHint: its mean and variance run over all h features of a token, which no "
                f"rank could compute from a slice: every rank holds all of the LayerNorm's "
                f"weight and bias and normalises the whole (b, s, h) activation itself.")
    if how is None:
        return (f"your parameter {name} is a 1/{t} slice of {dense}, a bias added after g: "
                f"every rank holds all of it and adds it once, to the sum.")
    if how == "heads":
        return (f"your parameter {name} is a contiguous 1/{t} of the fused q/k/v weight.\n"
                f"Hint: take this rank's heads' rows of each of q, k and v (your shard_qkv).")
    if dim == how and chunk != me:
        return (f"your parameter {name} is chunk {chunk} of {dense}, but this is rank {me} of "
                f"the group.\nHint: use the rank in the group, dist.get_rank(group).")
    return (f"your parameter {name} cuts {dense} along dim {dim}; rank r keeps "
            f"{refs.HOW[how]}.")


# ---- every parameter's gradient --------------------------------------------------------------
def _grade_gradients(ex, outs, found, groups, where, want):
    full, grads = want[2], want[3]
    for rank, (out, match) in enumerate(zip(outs, found)):
        t, me, at = len(groups[rank]), groups[rank].index(rank), _at(ex, rank, where)
        got = out["block"]["grads"]
        for name, (dense, part) in match.items():
            expected = _piece(refs.expected_shard(dense, grads[dense], me, t), part)
            if got[name] is None:
                raise checks.CheckFailed(f"{at}: your parameter {name} ({dense}) got no "
                                         f"gradient.\nHint: is it used in forward?")
            if messages.close(got[name], expected):
                continue
            if refs.layout(dense) is None and dense.startswith("ln") and t > 1 \
                    and _partial_sums(outs, found, groups[rank], dense, grads[dense]):
                raise checks.CheckFailed(
                    f"{at}: the gradient of {dense} (your {name}) is this rank's part of it "
                    f"only: summed over the group, the ranks' gradients are the dense one."
                    f"\nHint: f belongs after the LayerNorm, right before the column-parallel "
                    f"layer: its backward all-reduce then completes the gradient before it "
                    f"reaches the LayerNorm, which every rank holds whole.")
            checks.expect_close(ex, got[name], expected, rank=rank, world_size=len(outs),
                                **TOLERANCE,
                                what=f"the gradient of your {name}, this rank's slice of "
                                     f"{dense} (group = {where})")


def _piece(shard, part):
    return shard if part is None else shard.chunk(3)["qkv".index(part)]


def _partial_sums(outs, found, group, dense, want):
    """Whether the group's gradients of the whole parameter ``dense`` add up to ``want``."""
    parts = []
    for rank in group:
        name = next((s for s, key in found[rank].items() if key == (dense, None)), None)
        parts.append(None if name is None else outs[rank]["block"]["grads"][name])
    return all(isinstance(p, torch.Tensor) for p in parts) and messages.close(sum(parts), want)


# ---- refusing heads that do not divide, and training -------------------------------------------
def _grade_refusal(ex, refusal, rank, t):
    if refusal.get("raised") == "ValueError":
        return
    did = (f"raised {refusal['raised']}: {refusal['message']}" if "raised" in refusal
           else "was built without complaint")
    raise checks.CheckFailed(
        f"{ex}: rank {rank}: cut from a block with 4 heads on t = {t} ranks, your block {did}."
        f"\nHint: raise a ValueError naming both numbers: each rank must hold whole heads "
        f"(your shard_qkv from Exercise 5.4 does it).")


def _grade_training(ex, train, rank, n, group, where, dense):
    t, me, at = len(group), group.index(rank), _at(ex, rank, where)
    if train["error"] is not None:
        raise checks.CheckFailed(f"{at}: {train['error']}")
    want = torch.tensor(dense["losses"], dtype=torch.float64)
    if not messages.close(train["losses"], want):
        steps = "; ".join(f"step {i + 1}: {a:.6f} with your blocks, {b:.6f} dense"
                          for i, (a, b) in enumerate(zip(train["losses"].tolist(),
                                                         want.tolist())))
        raise checks.CheckFailed(
            f"{at}: the GPT built from your blocks trains differently from the dense GPT: "
            f"{steps}.\nHint: the block alone was right, so look at what a model adds: is "
            f"every slice a parameter that the optimizer sees, and does the block keep no "
            f"state from one call to the next?")
    found = _grade_parameters(at, train["before"], dense["before"], me, t, "the dense GPT")
    for name, (full_name, part) in found.items():
        expected = _piece(refs.expected_shard(full_name, dense["after"][full_name], me, t), part)
        checks.expect_close(ex, train["after"][name], expected, rank=rank, world_size=n,
                            rtol=1e-4, atol=1e-5,
                            what=f"your {name} after {STEPS} AdamW steps (this rank's slice "
                                 f"of the dense GPT's {full_name}, group = {where})")
