"""Choosing a backend, joining the process group, and what each backend supports.

``backend="auto"`` means NCCL with one GPU per rank (``cuda:LOCAL_RANK``) when
torch sees at least ``nproc`` GPUs, otherwise gloo on CPU processes. Nothing
here touches CUDA unless a GPU backend was asked for and is available.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl", "mpi")

# Which torch.distributed calls each backend implements on which device, as the
# lecture notes tabulate it (PyTorch's docs of that era; "?" = depends on the MPI
# build). Newer gloo builds do more: Lab 00 probes the installed one.
SUPPORT_TABLE = {
    #  op:            gloo CPU, gloo GPU, mpi CPU, mpi GPU, nccl CPU, nccl GPU
    "send":           ("yes", "no", "yes", "?", "no", "yes"),
    "recv":           ("yes", "no", "yes", "?", "no", "yes"),
    "broadcast":      ("yes", "yes", "yes", "?", "no", "yes"),
    "all_reduce":     ("yes", "yes", "yes", "?", "no", "yes"),
    "reduce":         ("yes", "no", "yes", "?", "no", "yes"),
    "all_gather":     ("yes", "no", "yes", "?", "no", "yes"),
    "gather":         ("yes", "no", "yes", "?", "no", "yes"),
    "scatter":        ("yes", "no", "yes", "?", "no", "no"),
    "reduce_scatter": ("no", "no", "no", "no", "no", "yes"),
    "all_to_all":     ("no", "no", "yes", "?", "no", "yes"),
    "barrier":        ("yes", "no", "yes", "?", "no", "yes"),
}
SUPPORT_COLUMNS = ("gloo CPU", "gloo GPU", "mpi CPU", "mpi GPU", "nccl CPU", "nccl GPU")


def gpu_count():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend, nproc):
    """The concrete backend for ``nproc`` ranks *on this node* (a multi-node job needs one
    GPU per rank of each node, not per rank of the world); raises ValueError (before
    anything starts) when the request cannot work here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        return "nccl" if dist.is_nccl_available() and gpu_count() >= nproc else "gloo"
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ValueError("backend='nccl' but this torch build has no NCCL (a CPU build?)")
        if gpu_count() < nproc:
            raise ValueError(f"backend='nccl' needs one GPU per rank of this node: {nproc} ranks but "
                             f"torch sees {gpu_count()} GPU(s). Use backend='gloo' or 'auto'.")
    if backend == "mpi" and not dist.is_mpi_available():
        raise ValueError("backend='mpi' but this torch build was not compiled with MPI")
    if backend == "gloo" and not dist.is_gloo_available():
        raise ValueError("backend='gloo' but this torch build has no gloo")
    return backend


def current_device():
    """The device this rank computes on: ``cuda:LOCAL_RANK`` under NCCL, else CPU.

    The one place a rank's device is decided, from the job's backend and never
    from the accelerator the process happens to see: two gloo ranks on a laptop
    with one GPU (the most common student GPU) compute on the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def device_mesh(shape=None, names=None, group=None):
    """A ``DeviceMesh`` on this rank's device type (:func:`current_device`).

    ``shape`` and ``names``: a mesh over the whole world (``init_device_mesh``);
    ``group``: a 1-D mesh over that group's ranks. torch's own default meshes
    (``fully_shard`` without ``mesh=``, ``init_device_mesh("cuda", ...)`` in
    examples) take the accelerator the process sees, so gloo ranks on a machine
    with one GPU would all reach for ``cuda:rank``: every mesh of the course is
    made here instead and handed over explicitly::

        fully_shard(block, mesh=device_mesh())
        dims = device_mesh((2, 2), ("dp", "tp"))
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    kind = current_device().type
    if group is not None:
        if shape is not None:
            raise ValueError("give a group or a shape, not both")
        return DeviceMesh(kind, dist.get_process_group_ranks(group))
    shape = (dist.get_world_size(),) if shape is None else tuple(shape)
    return init_device_mesh(kind, shape, mesh_dim_names=None if names is None else tuple(names))


def backend_for(nproc, backend):
    """``backend`` for a cell that needs ``nproc`` ranks, or gloo where this node cannot
    run them on it (NCCL needs a GPU per rank), saying so: a lab run on one GPU still
    runs its two-rank demos."""
    if backend == "nccl" and gpu_count() < nproc:
        print(f"({nproc} NCCL ranks need {nproc} GPUs and torch sees {gpu_count()}: "
              f"this cell runs on gloo)")
        return "gloo"
    return backend


def enough_ranks(need, nproc, backend):
    """``(nproc, backend)`` for a demo that needs at least ``need`` ranks: the notebook's
    own when it has that many, else ``need`` ranks on a backend that can run them
    (:func:`backend_for`), saying so (a ring of one rank shows nothing).

        n, b = enough_ranks(2, NPROC, BACKEND)
        run(ping_pong_job, nproc=n, backend=b)
    """
    if nproc >= need:
        return nproc, backend
    print(f"(this cell needs {need} ranks and NPROC={nproc}: it runs {need})")
    return need, backend_for(need, backend)


def node_backend(backend="auto"):
    """The backend a rank started by torchrun uses: ``COURSE_BACKEND`` (what the launcher
    resolved) for "auto", checked against the GPUs of this node for the ranks of this
    node (``LOCAL_WORLD_SIZE``: 4 on each of 2 nodes of 4 GPUs, not the world's 8)."""
    if backend == "auto":  # the launcher already resolved it for the whole job
        backend = os.environ.get("COURSE_BACKEND", "auto")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    return resolve_backend(backend, local)


def init_distributed(backend="auto", timeout_s=None):
    """Join the default process group from torchrun's environment variables
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Idempotent."""
    if dist.is_initialized():
        return dist.get_backend()
    backend = node_backend(backend)
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend, **kwargs)
    return backend


def probe_ops():
    """Try every op of :data:`SUPPORT_TABLE` on the current process group with
    tiny tensors; returns {op: "yes" or "no (<error>)"}. Run it on >= 2 ranks.
    An unsupported op raises on every rank alike, so the group stays in step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = current_device()

    def t(value=1.0, n=world):
        return torch.full((n,), float(value), device=device)

    ops = {
        "send": lambda: dist.send(t(), 1) if rank == 0 else (dist.recv(t(), 0) if rank == 1 else None),
        "recv": lambda: dist.recv(t(), 1) if rank == 0 else (dist.send(t(), 0) if rank == 1 else None),
        "broadcast": lambda: dist.broadcast(t(rank), src=0),
        "all_reduce": lambda: dist.all_reduce(t(rank)),
        "reduce": lambda: dist.reduce(t(rank), dst=0),
        "all_gather": lambda: dist.all_gather([t() for _ in range(world)], t(rank)),
        "gather": lambda: dist.gather(t(rank), [t() for _ in range(world)] if rank == 0 else None),
        "scatter": lambda: dist.scatter(t(), [t(r) for r in range(world)] if rank == 0 else None),
        "reduce_scatter": lambda: dist.reduce_scatter(t(), [t(rank) for _ in range(world)]),
        "all_to_all": lambda: dist.all_to_all([t() for _ in range(world)],
                                              [t(rank) for _ in range(world)]),
        "barrier": lambda: dist.barrier(),
    }
    result = {}
    for name, op in ops.items():
        try:
            op()
            result[name] = "yes"
        except Exception as exc:  # noqa: BLE001 - the error is the answer
            result[name] = f"no ({type(exc).__name__}: {str(exc).splitlines()[0][:60]})"
    return result


# torch 2.13 renamed the flat-tensor collectives (the old names warn); older
# releases only have the old ones. Same signatures: (output, input, ...).
builtin_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
builtin_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
