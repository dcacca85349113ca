"""One step of torch's ``DataParallel``, played on ranks: rank 0 is its "device 0".

``nn.DataParallel`` is one process driving K devices, with device 0 as the hub.
In every step it

1. **scatters** the batch: slice k of the input goes to device k;
2. **replicates** the model: every parameter and buffer is copied to every other
   device (every step: the replicas are thrown away afterwards);
3. runs each replica's forward on its slice;
4. **gathers** the outputs on device 0, where the loss is computed;

and backward retraces the same arrows:

5. the gradient of the loss with respect to each output slice goes back to the
   device that computed it (the backward of the gather is a scatter);
6. each replica runs its backward;
7. the replicas' gradients are **reduced** (added) onto device 0 (the backward of
   the replication), which then takes the optimizer step alone.

:func:`dp_step` does exactly that with one rank per device and a counted message
(:mod:`course_lib.comm`) per arrow, so ``comm.counting()`` on rank 0 measures
what flows through DataParallel's device 0::

    loss = dp_step(model, x, y)        # on every rank; rank 0's x and y are the batch
    if dist.get_rank() == 0:
        opt.step()                     # rank 0 holds the whole batch's gradient

Slices are cut as DataParallel cuts them (``x.chunk(K)``: ceil(B/K) rows each, the
last one shorter, and fewer than K slices when B is small); a rank without a slice
takes no part in the step.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import comm, trace

PHASES = ("scatter", "replicate", "gather", "scatter grad", "reduce grads")


def slice_sizes(rows, k):
    """Rows of each slice, as ``torch.chunk`` cuts ``rows`` rows into ``k`` pieces."""
    if rows <= 0:
        return []
    per = -(-rows // k)
    return [min(per, rows - start) for start in range(0, rows, per)]


def _by_dtype(tensors):
    """[(tensors of one dtype)], in order of first appearance: one flat message each."""
    groups = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _flatten(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflatten_into(flat, tensors):
    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(piece.view_as(t))


def _flat_like(tensors):
    return torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                       device=tensors[0].device)


def _grads(params):
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


@contextmanager
def _phase(name, phases):
    """One phase: a span on the timeline and, when ``phases`` is a dict, its bytes
    as comm's counters saw them. The phases' counters never nest (nested counting()
    blocks can drop each other: CommStats compare equal by value), so the caller
    adds the phases up rather than wrapping the step in a counting() of its own."""
    with trace.span(name, "comm"):
        if phases is None:
            yield
            return
        with comm.counting() as stats:
            yield
        phases[name] = {"sent": stats.sent_bytes, "received": stats.recv_bytes}


def dp_step(model, x, y, loss_fn=F.mse_loss, group=None, phases=None):
    """Forward and backward of one DataParallel step over the ranks of ``group``.

    Every rank passes a model of the same architecture and ``x``, ``y`` of the same
    shapes and dtypes; only rank 0's values are used (the other ranks' are shape
    templates: DataParallel's batch lives on device 0 alone), and its weights are
    copied onto the others. Afterwards rank 0's parameters hold the gradient of
    ``loss_fn(model(x), y)`` on the whole batch, accumulated into ``.grad`` like a
    plain backward; the replicas' gradients are cleared. Returns the loss on rank 0,
    None elsewhere. ``phases``, a dict, receives this rank's {"sent", "received"}
    bytes per phase (:data:`PHASES`)."""
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must have as many rows: got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sizes = slice_sizes(x.shape[0], world)
    if not sizes:
        raise ValueError("DataParallel needs at least one row in the batch")
    if rank >= len(sizes):  # DataParallel starts no replica for a device without rows
        if phases is not None:
            phases.update({name: {"sent": 0, "received": 0} for name in PHASES})
        return None
    peers = range(1, len(sizes))
    params = [p for p in model.parameters() if p.requires_grad]
    state = [*model.parameters(), *model.buffers()]

    # 1. scatter: slice r of the batch to rank r
    with _phase("scatter", phases):
        if rank == 0:
            slices = x.chunk(world)
            comm.exchange(sends=[(slices[r].contiguous(), r) for r in peers], group=group)
            mine = slices[0]
        else:
            mine = torch.empty((sizes[rank], *x.shape[1:]), dtype=x.dtype, device=x.device)
            comm.exchange(recvs=[(mine, 0)], group=group)

    # 2. replicate: rank 0's parameters and buffers overwrite every replica's
    with _phase("replicate", phases):
        if rank == 0:
            flats = [_flatten(same_dtype) for same_dtype in _by_dtype(state)]
            comm.exchange(sends=[(flat, r) for r in peers for flat in flats], group=group)
        else:
            groups = _by_dtype(state)
            flats = [_flat_like(same_dtype) for same_dtype in groups]
            comm.exchange(recvs=[(flat, 0) for flat in flats], group=group)
            with torch.no_grad():
                for flat, same_dtype in zip(flats, groups):
                    _unflatten_into(flat, same_dtype)

    # 3. every replica's forward on its slice
    with trace.span("forward", "compute"):
        out = model(mine)

    # 4. gather the outputs on rank 0, which computes the loss of the whole batch
    with _phase("gather", phases):
        if rank == 0:
            theirs = [torch.empty((sizes[r], *out.shape[1:]), dtype=out.dtype, device=out.device)
                      for r in peers]
            comm.exchange(recvs=list(zip(theirs, peers)), group=group)
        else:
            comm.exchange(sends=[(out.detach().contiguous(), 0)], group=group)

    loss = None
    with trace.span("loss and backward", "compute"):
        if rank == 0:
            # the others' outputs are leaves here: backward stops at them, and their
            # .grad is what each replica needs to continue its own backward
            leaves = [t.requires_grad_() for t in theirs]
            loss = loss_fn(torch.cat([out, *leaves]), y)
            loss.backward()

    # 5. the gradient of each output slice back to the rank that computed it
    with _phase("scatter grad", phases):
        if rank == 0:
            grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                     for leaf in leaves]  # a loss that ignores a slice gives it no gradient
            comm.exchange(sends=list(zip(grads, peers)), group=group)
        else:
            grad_out = torch.empty_like(out)
            comm.exchange(recvs=[(grad_out, 0)], group=group)

    # 6. each replica's backward
    if rank != 0:
        with trace.span("backward", "compute"):
            for p in params:
                p.grad = None  # a replica starts from nothing, as DataParallel's fresh copies
            out.backward(grad_out)

    # 7. reduce the replicas' gradients onto rank 0
    with _phase("reduce grads", phases):
        if rank == 0:
            groups = _by_dtype(params)
            incoming = [[_flat_like(same_dtype) for same_dtype in groups] for _ in peers]
            comm.exchange(recvs=[(flat, r) for r, flats in zip(peers, incoming) for flat in flats],
                          group=group)
            with torch.no_grad():
                for same_dtype in groups:
                    for p in same_dtype:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                for flats in incoming:
                    for flat, same_dtype in zip(flats, groups):
                        sizes = [p.numel() for p in same_dtype]
                        for p, piece in zip(same_dtype, flat.split(sizes)):
                            p.grad.add_(piece.view_as(p))
        else:
            flats = [_flatten(_grads(same_dtype)) for same_dtype in _by_dtype(params)]
            comm.exchange(sends=[(flat, 0) for flat in flats], group=group)
            for p in params:
                p.grad = None
    return None if loss is None else loss.detach()


__all__ = ["dp_step", "slice_sizes", "PHASES"]
