"""The inputs of Lab 01's checks and the results they expect, computed by the check.

Every case's inputs are made here, for every rank, from fixed seeds (or a
pattern): the check hands them to the student's ranks as request arguments and
works out what each rank must end with in its own process, by reducing,
gathering or copying those same inputs with course_lib's ``combine``. No torch
collective runs on the student's ranks to make a reference.

The first cases of every check are small and patterned, so that a failure shows
where each number came from (element j of chunk c on rank i is 100c + 10i + j);
the random ones come after, several elements before single ones.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.collectives.reduce_ops import combine

SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX
PATTERN_NUMEL = 7  # fits in the 8 values a failure message shows
UNWRITTEN = -1  # what a patterned case's output holds before the student's call


# ---- inputs --------------------------------------------------------------------------------
def random_input(numel, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-100, 100, (numel,), generator=gen, device="cpu")
    return torch.randn(numel, generator=gen, dtype=dtype, device="cpu")


def patterned(rank, chunks, numel):
    """Element j of chunk c on ``rank`` is 100c + 10 rank + j: readable in a failure."""
    c = torch.arange(chunks, device="cpu").repeat_interleave(numel)
    j = torch.arange(numel, device="cpu").repeat(chunks)
    return 100 * c + 10 * rank + j


def cases(sizes, dtypes=(torch.int64, torch.float32), ops=(SUM, MAX)):
    """[(numel, dtype, op, patterned)]: the patterned integer cases first, then random
    ones, several elements before single ones (a 1-element failure shows no pattern)."""
    first = [(PATTERN_NUMEL, torch.int64, op, True) for op in ops]
    ordered = sorted(sizes, key=lambda n: (n < 2, n))
    return first + [(n, dt, op, False) for n in ordered for dt in dtypes for op in ops]


def inputs_of(cases, world, chunks=1):
    """For each case (its index i), every rank's input: ``chunks`` chunks of ``numel``
    elements, patterned or drawn with seed 100 i + rank."""
    return [[patterned(rank, chunks, numel) if pattern
             else random_input(chunks * numel, dtype, 100 * i + rank)
             for rank in range(world)]
            for i, (numel, dtype, _, pattern) in enumerate(cases)]


def output_fill(pattern):
    """What the output buffer handed to the student holds: uninitialised, as in real
    use (None), except in a patterned case, where every value shown should mean something."""
    return UNWRITTEN if pattern else None


def broadcast_cases(world, sizes):
    """[(numel, src, segments)] for a world of ``world`` ranks: each size from the first
    and the last rank, in 4 segments and in 1."""
    return [(numel, src, seg) for numel in sorted(sizes, key=lambda m: (m < 2, m))
            for src in sorted({0, world - 1}) for seg in (4, 1)]


def broadcast_input(rank, numel):
    """What rank ``rank`` holds before the broadcast: 1000 rank + j."""
    return torch.arange(numel, dtype=torch.float32, device="cpu") + 1000 * rank


# ---- expected results ----------------------------------------------------------------------
def reduce(tensors, op):
    """``op`` over ``tensors``, element by element, in one process."""
    acc = tensors[0].clone()
    for t in tensors[1:]:
        combine(acc, t, op)
    return acc


def chunks(t, numel):
    """``t`` cut into pieces of ``numel`` elements."""
    return [t[c * numel:(c + 1) * numel] for c in range(t.numel() // numel)] if numel else []


def all_reduce_result(inputs, op):
    """What every rank holds after an all-reduce of ``inputs`` (one per rank)."""
    return reduce(inputs, op)


def reduce_scatter_results(inputs, op, numel):
    """[chunk r of the reduction of ``inputs``, for each rank r]."""
    return chunks(reduce(inputs, op), numel)


def all_gather_result(inputs):
    """What every rank's output holds after an all-gather: rank c's input in chunk c."""
    return torch.cat(inputs)
