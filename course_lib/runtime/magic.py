"""``%%torchrun``: run a notebook cell as an SPMD program on N ranks.

    %load_ext course_lib
    %%torchrun -n 4 --timeout 60
    print(rank, world_size)          # also: local_rank, device, dist, torch

The cell runs on every rank inside an initialised process group. Functions and
classes defined in earlier cells, imported modules and simple values
(numbers, strings, tensors) travel with it by value; anything that cannot be
pickled is left behind (the cell will say NameError if it needed it).
"""
from __future__ import annotations

import argparse
import shlex
import types

import cloudpickle

from course_lib.runtime.launcher import run_cell

_SIMPLE = (int, float, str, bool, bytes, type(None))


def _parser():
    p = argparse.ArgumentParser(prog="%%torchrun", add_help=False)
    p.add_argument("-n", "--nproc", type=int, default=2)
    p.add_argument("-b", "--backend", default="auto")
    p.add_argument("-t", "--timeout", type=float, default=120.0)
    return p


def shippable_namespace(user_ns):
    """The part of the notebook's namespace a cell can take to the ranks."""
    import torch

    out = {}
    for name, value in user_ns.items():
        if name.startswith("_") or name in ("In", "Out", "exit", "quit", "get_ipython"):
            continue
        ok = (isinstance(value, (types.ModuleType, *_SIMPLE, torch.Tensor))
              or (isinstance(value, (types.FunctionType, type))
                  and getattr(value, "__module__", None) == "__main__")
              or isinstance(value, (list, tuple, dict)) and _small(value))
        if not ok:
            continue
        try:
            cloudpickle.dumps(value)
        except Exception:  # noqa: BLE001 - unpicklable values simply stay behind
            continue
        out[name] = value
    return out


def _small(container):
    items = container.values() if isinstance(container, dict) else container
    return len(container) <= 1000 and all(isinstance(v, _SIMPLE) for v in items)


def torchrun(line, cell, user_ns=None):
    try:
        args = _parser().parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(f"usage: %%torchrun [-n NPROC] [-b BACKEND] [-t TIMEOUT]; got {line!r}")
    namespace = shippable_namespace(user_ns or {})
    namespace.setdefault("torch", __import__("torch"))
    namespace.setdefault("dist", __import__("torch.distributed", fromlist=["_"]))
    run_cell(cell, namespace, nproc=args.nproc, backend=args.backend, timeout=args.timeout)


def register(ipython):
    def _magic(line, cell):
        return torchrun(line, cell, ipython.user_ns)

    ipython.register_magic_function(_magic, magic_kind="cell", magic_name="torchrun")
