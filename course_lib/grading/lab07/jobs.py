"""What runs on the student's ranks for Lab 07's checks: the student's code, and a
report (values, traffic, floating-point operations) as plain data. Nothing here works
out what the answer should be: the checks do, in their own process (:mod:`.references`)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from course_lib import comm
from course_lib.grading.lab07 import references


def _group(use_pair):
    """The world, or ranks {0, 1} of 3 as one group and rank 2 alone (every rank makes both)."""
    if not use_pair:
        return None
    pair, alone = dist.new_group([0, 1]), dist.new_group([2])
    return pair if dist.get_rank() < 2 else alone


def all_to_all_job(fn, use_pair, cases_by_size):
    """``cases_by_size[g]``: [(sends, width, dtype)] for a group of g ranks ->
    [(output, traffic)] of this rank's group. The output buffer starts at -1
    everywhere: rows never written stay -1."""
    group = _group(use_pair)
    rank = dist.get_rank(group)
    out = []
    for sends, width, dtype in cases_by_size[dist.get_world_size(group)]:
        inp = references.all_to_all_input(sends, rank, width, dtype)
        recv = [row[rank] for row in sends]
        shape = (sum(recv),) + ((width,) if width else ())
        output = torch.full(shape, -1, dtype=dtype)
        with comm.counting() as stats:
            fn(output, inp, recv, list(sends[rank]), group)
        out.append((output, stats.as_dict()))
    return out


def ring_forward_job(fn, use_pair):
    """This rank's chunk of q, k, v -> (output, traffic, floating-point operations)."""
    group = _group(use_pair)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    q, k, v = (z.chunk(n, dim=-2)[r].contiguous() for z in references.ring_qkv(n))
    with comm.counting() as stats, FlopCounterMode(display=False) as flops:
        got = fn(q, k, v, group)
    return got, stats.as_dict(), flops.get_total_flops()
