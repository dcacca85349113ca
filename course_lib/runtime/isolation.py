"""What a warm rank resets between calls, so each call starts as a fresh job would.

A warm rank runs many notebook calls in one process. Anything a call changes
in the process's global state would leak into the next call; :class:`Baseline`
records that state once, before the first call, and puts it back before every
call:

- torch's default dtype and default device;
- the RNG states of torch (CPU and, on GPU ranks, CUDA), numpy and ``random``:
  every call draws the same numbers the first call drew, as a fresh job would;
- grad mode, deterministic-algorithm flags, cuDNN flags, torch's thread count, the
  float32 matmul precision and TF32 flags; on a GPU rank its current device and
  stream (the default one), and the peak-memory statistics;
- the working directory (the notebook's current one, sent with each call) and
  ``sys.argv``;
- process groups a call created are destroyed after it; the default group stays;
- course_lib's own per-rank state: communication counters, the trace recorder.

Not reset: module-level state of modules the user imported (documented in
the README; ``run(..., fresh=True)`` gives a brand-new job).
"""
from __future__ import annotations

import os
import random
import sys

import torch
import torch.distributed as dist


def _numpy_random():
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random


def _live_groups():
    """The process groups torch currently knows, the default one included."""
    world = dist.distributed_c10d._world
    return set(world.pg_map) if dist.is_initialized() else set()


class Baseline:
    """The state of this rank right after start-up; :meth:`restore` returns to it."""

    def __init__(self, default_device=None):
        self.default_device = default_device
        self.dtype = torch.get_default_dtype()
        self.torch_rng = torch.get_rng_state()
        self.cuda_rng = (torch.cuda.get_rng_state_all()
                         if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
        np_random = _numpy_random()
        self.numpy_rng = np_random.get_state() if np_random is not None else None
        self.python_rng = random.getstate()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.deterministic_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        self.cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
        self.threads = torch.get_num_threads()
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        self.argv = list(sys.argv)
        self.groups = _live_groups()

    def restore(self, cwd=None):
        """Before a call: every item of the module docstring back as it was."""
        torch.set_default_dtype(self.dtype)
        torch.set_default_device(self.default_device)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if self.numpy_rng is not None:
            _numpy_random().set_state(self.numpy_rng)
        random.setstate(self.python_rng)
        torch.set_grad_enabled(True)
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != \
                (self.deterministic, self.deterministic_warn_only):
            # only when a call changed it: its first call imports seconds of torch
            torch.use_deterministic_algorithms(self.deterministic,
                                               warn_only=self.deterministic_warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = self.cudnn
        torch.set_num_threads(self.threads)
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.tf32
        if self.default_device is not None and self.default_device.type == "cuda":
            # the rank's GPU and its default stream, and memory peaks counted from here
            torch.cuda.set_device(self.default_device)
            torch.cuda.set_stream(torch.cuda.default_stream(self.default_device))
            torch.cuda.reset_peak_memory_stats(self.default_device)
        sys.argv[:] = self.argv
        if cwd is not None:
            os.chdir(cwd)
        _reset_course_lib_state()

    def release_groups(self):
        """After a call: destroy the process groups it created, in the same order on
        every rank (by name, as torch does: NCCL's teardown of a communicator can wait
        for its peers). Returns False when the call destroyed the default group itself
        (the rank cannot serve again)."""
        if not dist.is_initialized():
            return False
        for group in sorted(_live_groups() - self.groups, key=_group_order):
            dist.destroy_process_group(group)
        from course_lib.collectives.reduce_ops import forget_groups

        forget_groups(_live_groups())  # scratch buffers of groups that are gone
        return True


def _group_order(group):
    """Groups are named "0", "1", ... in creation order (or by the user): numbers first,
    in numeric order, then names."""
    name = dist.distributed_c10d._world.pg_names.get(group, "")
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _reset_course_lib_state():
    from course_lib import comm, trace

    comm._active.clear()
    if trace.get_tracer() is not None:
        trace.finish()
