"""All-to-all from the counted send/recv layer (Lab 07: the dispatch of expert
parallelism, and the layout changes of context parallelism).

Rank r's ``input`` is cut along dim 0 into K pieces, ``input_splits[p]`` rows for
peer p; afterwards rank r's ``output`` holds, in peer order, the piece every peer cut
for r (``output_splits[p]`` rows from p). Without splits the K pieces are equal, as in
``torch.distributed.all_to_all_single``. Every rank sends all but its own piece at
once, in one :func:`~course_lib.comm.exchange`: (K-1) messages and one round of
latency, each piece on the link between its two ranks. A piece of zero rows is not
sent (both ends know its size from the splits).

:func:`all_to_all_v` is the form a mixture-of-experts layer needs: a rank knows what it
sends to each expert's rank but not what it will receive, so the counts go first (an
all-to-all of one integer per peer), then the rows::

    received, counts = all_to_all_v(tokens, tokens_per_rank, group=ep_group)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.collectives.reduce_ops import asynchronous, validate


def _splits(splits, rows, world, name):
    if splits is None:
        if rows % world:
            raise ValueError(f"{name} has {rows} rows, which {world} ranks cannot split "
                             f"evenly: pass {name.split()[0]}_splits")
        return [rows // world] * world
    splits = [int(s) for s in splits]
    if len(splits) != world or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"{name}: splits {splits} must be {world} non-negative row counts "
                         f"adding up to its {rows} rows")
    return splits


def _offsets(splits):
    out, at = [], 0
    for s in splits:
        out.append(at)
        at += s
    return out


@asynchronous
def all_to_all(output, input, output_splits=None, input_splits=None, group=None):
    """``torch.distributed.all_to_all_single`` on the course's point-to-point layer, in
    place into ``output`` (see the module's docstring); ``group``-local peers."""
    validate(input, name="input", group=group)
    validate(output, name="output", group=group)
    if output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
        raise ValueError(f"output {tuple(output.shape)} {output.dtype} and input "
                         f"{tuple(input.shape)} {input.dtype} must share dtype and row shape")
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError("an all-to-all splits dim 0: a 0-d tensor has none")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send = _splits(input_splits, input.shape[0], world, "input (dim 0)")
    recv = _splits(output_splits, output.shape[0], world, "output (dim 0)")
    send_at, recv_at = _offsets(send), _offsets(recv)
    if send[rank] != recv[rank]:
        raise ValueError(f"rank {rank} sends itself {send[rank]} rows but expects "
                         f"{recv[rank]}: the splits disagree")
    staged = {}  # a non-contiguous output piece is received into a buffer, then copied
    sends, recvs = [], []
    for peer in range(world):
        if peer == rank:
            continue
        if send[peer]:
            sends.append((input.narrow(0, send_at[peer], send[peer]).contiguous(), peer))
        if recv[peer]:
            target = output.narrow(0, recv_at[peer], recv[peer])
            buffer = target if target.is_contiguous() else torch.empty_like(target)
            staged[peer] = (target, buffer)
            recvs.append((buffer, peer))
    comm.exchange(sends=sends, recvs=recvs, group=group)
    for target, buffer in staged.values():
        if buffer is not target:
            target.copy_(buffer)
    if send[rank]:
        mine = input.narrow(0, send_at[rank], send[rank])
        output.narrow(0, recv_at[rank], recv[rank]).copy_(mine)
    return output


def all_to_all_v(input, input_splits, group=None):
    """(output, output_splits): the counts are exchanged first, then the rows. Each
    rank passes the rows it sends each peer; it learns what each peer sends it."""
    world = dist.get_world_size(group)
    counts = torch.tensor([int(s) for s in input_splits], dtype=torch.int64,
                          device=input.device)
    if counts.numel() != world:
        raise ValueError(f"input_splits needs one count per rank ({world}), got "
                         f"{counts.numel()}")
    incoming = torch.empty_like(counts)
    all_to_all(incoming, counts, group=group)
    output_splits = incoming.tolist()
    output = input.new_empty((sum(output_splits), *input.shape[1:]))
    all_to_all(output, input, output_splits, list(input_splits), group=group)
    return output, output_splits
