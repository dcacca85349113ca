"""What runs on the student's ranks for Lab 01's checks: the student's collective, and a report.

Each job gets the cases from the request, every rank's input included (the
check chose them: :mod:`~course_lib.grading.lab01.references`), hands this
rank's copy to the student's function inside ``wire.counting()`` (and
``message_order()`` for the broadcast), and returns, for each case, what the
tensor holds afterwards and the traffic, as plain data. Nothing here computes
what the answer should be: the check does that in its own process.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.grading import wire
from course_lib.grading.message_order import message_order


def _output(numel, like, fill):
    """The output buffer handed to the student: uninitialised (``fill`` None), as in
    real use, or full of ``fill``."""
    if fill is None:
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    return torch.full((numel,), fill, dtype=like.dtype, device=like.device)


def all_reduce_job(fn, cases):
    """``cases``: [(inputs by rank, op)] -> [(tensor after fn(tensor, op), traffic)]."""
    rank = dist.get_rank()
    out = []
    for inputs, op in cases:
        got = inputs[rank].clone()
        with wire.counting(p2p_only=True) as stats:
            fn(got, op)
        out.append((got, stats.as_dict()))
    return out


def reduce_scatter_job(fn, cases):
    """``cases``: [(inputs by rank, op, output numel, output fill)]
    -> [(output after fn(output, input, op), traffic)]."""
    rank = dist.get_rank()
    out = []
    for inputs, op, numel, fill in cases:
        inp = inputs[rank].clone()
        got = _output(numel, inp, fill)
        with wire.counting(p2p_only=True) as stats:
            fn(got, inp, op)
        out.append((got, stats.as_dict()))
    return out


def all_gather_job(fn, cases):
    """``cases``: [(inputs by rank, output fill)] -> [(output after fn(output, input), traffic)]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for inputs, fill in cases:
        inp = inputs[rank].clone()
        got = _output(world * inp.numel(), inp, fill)
        with wire.counting(p2p_only=True) as stats:
            fn(got, inp)
        out.append((got, stats.as_dict()))
    return out


def broadcast_job(fn, cases):
    """``cases``: [(inputs by rank, src, segments)]
    -> [(tensor after fn(tensor, src, segments), traffic, order of its messages)]."""
    rank = dist.get_rank()
    out = []
    for inputs, src, segments in cases:
        got = inputs[rank].clone()
        with wire.counting(p2p_only=True) as stats, message_order() as events:
            fn(got, src, segments)
        out.append((got, stats.as_dict(), list(events)))
    return out


def adaptive_job(fn, cases, alpha, bandwidth):
    """Exercise 1.6: ``cases``: [(inputs by rank, op)] -> [(tensor after
    fn(tensor, op, alpha, bandwidth), traffic)]."""
    return all_reduce_job(lambda tensor, op: fn(tensor, op, alpha, bandwidth), cases)
