"""How far a ring all-reduce in bf16 drifts from the exact sum as the ranks grow
(Lab 03, section 9; the hook that compresses DDP's gradients to bf16 is Lab 02's).

A ring all-reduce sums each chunk along the ring: K - 1 additions in sequence, each
rounded to the wire's dtype. bf16 keeps 8 significant bits (7 stored), so every
rounding may move a partial sum by up to 2^-8 of itself, and the partial sums grow
with K: more ranks, more roundings of larger numbers. fp32's 24 bits make the same
drift about 2^16 times smaller. This module measures it rather than argue it:

    drift = run(ring_drift, sizes=(2, 4, 8), nproc=8)[0]
    drift[8]["bf16"]   # |ring sum - exact sum| / |exact sum|, bf16 on the wire
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.collectives import ring
from course_lib.runtime.backend import current_device


def gradient_like(rank, numel, seed=0, shared=0.5):
    """Rank ``rank``'s contribution: a component every rank shares (``shared``, the
    signal of a gradient) plus noise of its own, in float64 for the exact sum."""
    common = torch.randn(numel, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64, device="cpu")
    own = torch.randn(numel, generator=torch.Generator().manual_seed(seed + 1 + rank),
                      dtype=torch.float64, device="cpu")
    return shared * common + own


def relative_error(got, exact):
    """||got - exact|| / ||exact||, in float64."""
    return float((got.double() - exact).norm() / exact.norm())


def ring_drift(sizes=(2, 3, 4, 6, 8), numel=1 << 15, seed=0):
    """On every rank of the world (at least ``max(sizes)`` ranks): for each K in
    ``sizes``, the ring all-reduce of :func:`gradient_like` on the first K ranks, in
    bf16 and in fp32. Rank 0 returns ``{K: {"bf16", "fp32", "bf16_once"}}``: the
    relative error of each against the exact sum, and of the exact sum rounded to
    bf16 once (the error no wire can avoid, the floor); the others return None."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if max(sizes) > world:
        raise ValueError(f"sizes {sizes} need {max(sizes)} ranks; the job has {world}")
    device = current_device()
    mine = gradient_like(rank, numel, seed)
    out = {}
    for k in sizes:
        group = dist.new_group(list(range(k)))  # every rank joins new_group, members or not
        if rank >= k:
            continue
        sums = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            tensor = mine.to(device=device, dtype=dtype)
            ring.all_reduce(tensor, group=group)
            sums[name] = tensor.cpu()
        if rank == 0:
            exact = sum(gradient_like(r, numel, seed) for r in range(k))
            out[k] = {name: relative_error(s, exact) for name, s in sums.items()}
            out[k]["bf16_once"] = relative_error(exact.to(torch.bfloat16), exact)
    return out if rank == 0 else None
