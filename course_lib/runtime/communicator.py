"""What ``init_process_group("nccl")`` does, spelled out in NCCL's own steps (Lab 00).

A NCCL **communicator** is one GPU's membership in a group of ``nranks`` GPUs. Making one
takes three steps in the C API:

1. ``ncclGetUniqueId(&id)`` on one rank: 128 opaque bytes that name the group (the
   address where its members find each other);
2. an **out-of-band** broadcast of ``id``: NCCL does not do it, the program does, with MPI
   in NCCL's examples and with the TCP store at ``MASTER_ADDR:MASTER_PORT`` in torch;
3. ``cudaSetDevice(d); ncclCommInitRank(&comm, nranks, id, rank)`` on every member, a
   collective call that returns when all have joined, after NCCL has read the topology
   (NVLink, PCIe, NICs) and planned its rings and trees.

A process that drives several GPUs holds one communicator per GPU. Each
``ncclCommInitRank`` waits for all members, so one thread calling them in turn would wait
forever at the first: the calls go between ``ncclGroupStart()`` and ``ncclGroupEnd()``,
which holds them back and completes them together (``ncclCommInitAll`` does it in one
call). The same holds for its collectives: the all-reduce of each of its GPUs inside one
group, then ``cudaStreamSynchronize`` on each GPU's stream for the results.

The buffers a collective takes are device pointers on the communicator's GPU (``sendbuff``
and ``recvbuff``, the same pointer for in place), a count of elements, an element type
(``ncclFloat``, ``ncclBfloat16``, ...), an op (``ncclSum``, ...) and the CUDA stream to
enqueue on. torch fills these from the tensor, runs one process per GPU (so one
communicator per process and group), and issues ``ncclGroupStart/End`` itself around
``batch_isend_irecv`` and coalesced collectives.

:func:`exchange_unique_id` is step 2 on the job's own store (it runs on gloo too);
:func:`one_process_all_reduce` is the single-process form on the GPUs this process sees.
"""
from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


def exchange_unique_id(store, rank, key="course_lib/unique_id"):
    """Step 2: rank 0 draws an id and sets it in ``store``; every other rank's ``get``
    waits until it is there. Returns the id (bytes), the same on every rank."""
    if rank == 0:
        unique_id = os.urandom(UNIQUE_ID_BYTES)
        store.set(key, unique_id)
        return unique_id
    return bytes(store.get(key))


def unique_id_job(key="course_lib/unique_id"):
    """On each rank of a running job: the id through the job's store (the one
    ``init_process_group`` used for its own), as (bytes, first 12 hex digits of its hash)."""
    # torch keeps the default group's store private; it is the store every rank reached
    # at MASTER_ADDR:MASTER_PORT when the group was made
    store = dist.distributed_c10d._get_default_store()
    unique_id = exchange_unique_id(store, dist.get_rank(), key)
    return len(unique_id), hashlib.sha256(unique_id).hexdigest()[:12]


def one_process_all_reduce(tensors):
    """Sum ``tensors`` (one per GPU, each on its own device) in place with one process
    driving them all: torch's ``torch.cuda.nccl.all_reduce`` makes a communicator per GPU
    (``ncclCommInitAll``) and issues the all-reduces as one group call.

    >>> xs = [torch.ones(4, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
    >>> one_process_all_reduce(xs)  # every x is now device_count() * ones
    """
    import torch.cuda.nccl as nccl

    devices = [t.device for t in tensors]
    if not tensors or any(d.type != "cuda" for d in devices) or len(set(devices)) < len(devices):
        raise ValueError(f"one tensor per GPU, each on a different CUDA device; got {devices}")
    if not nccl.is_available(tensors):
        raise ValueError("NCCL cannot take these tensors (dense, contiguous, one per device)")
    nccl.all_reduce(tensors)
    for t in tensors:
        torch.cuda.current_stream(t.device).synchronize()  # cudaStreamSynchronize
    return tensors
