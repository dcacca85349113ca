"""Which implementation runs a parallelism's collectives: torch's built-ins or Lab 01's ring.

DDP, FSDP and tensor parallelism never call a collective directly: they ask
:func:`collective_ops` for a set, so a lab can swap the student's (or the
course's) ring for torch's and compare, and so that ``comm.counting()`` sees
every call, whichever implementation ran it::

    ops = collective_ops("ring")                 # or "torch" (the default)
    with comm.counting() as stats:
        ops.all_reduce(x, group=tp_group)
    stats.collectives["all_reduce"], stats.collective_bytes["all_reduce"]   # 1, x.nbytes

Every function has torch's signature for the flat-tensor form, takes
``group=`` (None: the world) and ``async_op=``, and returns what torch
returns: None, or with ``async_op=True`` something with ``wait()``.

- ``all_reduce(tensor, op=SUM, group=None, async_op=False)``, in place
- ``all_gather(output, input, group=None, async_op=False)``: output = K inputs
- ``reduce_scatter(output, input, op=SUM, group=None, async_op=False)``:
  input = K outputs

The counted size is S, the whole array (nccl-tests' convention): the tensor of
an all-reduce, the output of an all-gather, the input of a reduce-scatter.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch.distributed as dist

from course_lib import comm

KINDS = ("torch", "ring")


def _builtins():
    from course_lib.runtime.backend import builtin_all_gather, builtin_reduce_scatter

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_gather(output, input, group=None, async_op=False):
        return builtin_all_gather(output, input, group=group, async_op=async_op)

    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return builtin_reduce_scatter(output, input, op=op, group=group, async_op=async_op)

    return all_reduce, all_gather, reduce_scatter


def _ring():
    from course_lib.collectives import ring

    return ring.all_reduce, ring.all_gather, ring.reduce_scatter


def collective_ops(kind="torch"):
    """The counted collectives of implementation ``kind`` ("torch" or "ring")."""
    if kind == "torch":
        all_reduce, all_gather, reduce_scatter = _builtins()
    elif kind == "ring":
        all_reduce, all_gather, reduce_scatter = _ring()
    else:
        raise ValueError(f"collectives must be one of {KINDS}, got {kind!r}")

    def counted_all_reduce(tensor, *args, **kwargs):
        comm.count_collective("all_reduce", tensor)
        return all_reduce(tensor, *args, **kwargs)

    def counted_all_gather(output, input, *args, **kwargs):
        comm.count_collective("all_gather", output)
        return all_gather(output, input, *args, **kwargs)

    def counted_reduce_scatter(output, input, *args, **kwargs):
        comm.count_collective("reduce_scatter", input)
        return reduce_scatter(output, input, *args, **kwargs)

    return SimpleNamespace(kind=kind, all_reduce=counted_all_reduce,
                           all_gather=counted_all_gather, reduce_scatter=counted_reduce_scatter)
