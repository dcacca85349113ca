"""Lab 05's jobs: what runs on the student's ranks (:func:`~course_lib.grading.requests.
on_ranks`). They only run the student's code and report what it did (values,
gradients, the all-reduces it made); the checks judge that against
:mod:`.references`.

All-reduces are counted per direction by wrapping ``torch.distributed.all_reduce``
on the ranks for the duration of a job: calls made through that attribute
(``dist.all_reduce(...)``, from the student's code or course_lib's collectives)
are counted, and a name imported before the job (``from torch.distributed import
all_reduce``) or another collective API is not.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

# module level, not inside the jobs: a job travels by value to a sandbox with no grader
from course_lib.grading.lab05.block_references import block_input, dense_block
from course_lib.grading.lab05.references import (SHAPE, attention_input, dense_mlp, mlp_input,
                                                 seeded, seeded_attention)
from course_lib.tp import ParallelAttention


@contextmanager
def all_reduces():
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


def pair_group():
    """Ranks 0 and 1 as one group, rank 2 alone (every rank creates both)."""
    pair, alone = dist.new_group([0, 1]), dist.new_group([2])
    return pair if dist.get_rank() < 2 else alone


# ---- 5.2: f and g ---------------------------------------------------------------------
def _run_operator(op, calls, group, x_seed, weight_seed):
    """Apply the student's f or g to a fresh leaf and backward through it: the output, the
    input's gradient, the all-reduces forward and backward, the input as it is after
    forward, and the gradient autograd handed to op's backward (as it was then, and after)."""
    x = seeded(x_seed, *SHAPE).requires_grad_()
    start = len(calls)
    y = op.apply(x, group)
    fwd = len(calls) - start
    x_after = x.detach().clone()
    incoming = []  # the gradient autograd hands to op's backward, and a copy of it
    if isinstance(y, torch.Tensor) and y.requires_grad:
        y.register_hook(lambda grad: incoming.append((grad, grad.detach().clone())))
    (y * seeded(weight_seed, *SHAPE)).sum().backward()
    return {"y": y.detach().clone(), "dx": x.grad, "fwd": fwd, "bwd": len(calls) - start - fwd,
            "x_after": x_after,
            "incoming": [incoming[0][0].detach().clone(), incoming[0][1]] if incoming else None}


def fg_job(copy_to_tp, reduce_from_tp, use_pair):
    group = pair_group() if use_pair else None
    rank = dist.get_rank()
    with all_reduces() as calls:
        f = _run_operator(copy_to_tp, calls, group, 1, 100 + rank)
        g = _run_operator(reduce_from_tp, calls, group, 200 + rank, 2)
    return f, g


# ---- 5.3: a parallel MLP --------------------------------------------------------------
def mlp_job(mlp_class, use_pair):
    """The student's module's parameters, then (output, X's gradient, the parameters'
    gradients, all-reduces forward, backward), or the error forward or backward raised."""
    group = pair_group() if use_pair else None
    module = mlp_class(dense_mlp(), group)
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    x, weight = mlp_input()
    try:
        with all_reduces() as calls:
            y = module(x)
            fwd = len(calls)
            (y * weight).sum().backward()
    except Exception as exc:  # noqa: BLE001 - graded by the check, with the shapes at hand
        return params, None, f"{type(exc).__name__}: {exc}"
    grads = {name: p.grad for name, p in module.named_parameters()}
    return params, (y.detach().clone(), x.grad, grads, fwd, len(calls) - fwd), None


# ---- 5.4: attention split by heads ------------------------------------------------------
def heads_job(shard_qkv, use_pair):
    """The course's parallel attention with the student's slice of q/k/v: its output and
    its input's gradient."""
    group = pair_group() if use_pair else None
    t, r = dist.get_world_size(group), dist.get_rank(group)
    attn = seeded_attention()
    parallel = ParallelAttention.from_dense(attn, group)
    with torch.no_grad():
        parallel.qkv.weight.copy_(shard_qkv(attn.qkv.weight.detach(), 6, r, t))
    x, weight = attention_input()
    y = parallel(x)
    (y * weight).sum().backward()
    return y.detach().clone(), x.grad


# ---- 5.6: a tensor-parallel block ---------------------------------------------------------
def _failure(what, exc):
    return f"{what} raised {type(exc).__name__}: {exc}"


def _one_block(block_class, group):
    """The student's block cut from the dense one: its parameters, then its output, X's
    gradient, its parameters' gradients and the all-reduces each way (or what raised)."""
    try:
        block = block_class(dense_block(), group)
    except Exception as exc:  # noqa: BLE001 - graded by the check
        return {"error": _failure(f"{block_class.__name__}(block, group)", exc)}
    params = {name: p.detach().clone() for name, p in block.named_parameters()}
    x, weight = block_input()
    try:
        with all_reduces() as calls:
            y = block(x)
            fwd = len(calls)
            (y * weight).sum().backward()
    except Exception as exc:  # noqa: BLE001 - graded by the check
        return {"params": params, "error": _failure("forward or backward", exc)}
    grads = {name: None if p.grad is None else p.grad.detach().clone()
             for name, p in block.named_parameters()}
    return {"params": params, "error": None, "y": y.detach().clone(), "dx": x.grad,
            "grads": grads, "fwd": fwd, "bwd": len(calls) - fwd}


def _refusal(block_class, group):
    """What the student's block does when the heads (4) do not divide by t (3)."""
    try:
        block_class(dense_block(heads=4), group)
    except Exception as exc:  # noqa: BLE001 - the check wants a ValueError, and says so
        return {"raised": type(exc).__name__, "message": str(exc)[:300]}
    return {"returned": True}


def _training(block_class, group, steps):
    """The GPT with the student's blocks, trained: losses (a tensor: a NaN travels too),
    this rank's parameters before and after."""
    from course_lib.tp.training import gpt_config, train_gpt

    try:
        out = train_gpt(gpt_config(), block_class, group, steps=steps, distinct=True,
                        keep_state=True)
    except Exception as exc:  # noqa: BLE001 - graded by the check
        return {"error": _failure("training the GPT with your blocks", exc)}
    return {"error": None, "losses": torch.tensor(out["losses"], dtype=torch.float64),
            "before": out["before"], "after": out["after"]}


def block_job(block_class, use_pair, steps, refusal):
    """5.6 on one rank: the block alone, the refusal of 4 heads on 3 ranks (where
    ``refusal``), and a few training steps of the GPT built from the student's blocks."""
    group = pair_group() if use_pair else None
    block = _one_block(block_class, group)
    return {"block": block, "refusal": _refusal(block_class, group) if refusal else None,
            "train": None if block["error"] else _training(block_class, group, steps)}
