"""Jupyter kernels that talk over Unix sockets (zmq ``ipc``), for notebooks run side by side.

A kernel started the usual way (``tcp``) gets five ports that ``jupyter_client`` picks by
binding port 0, noting the number and closing the socket; the kernel binds them a moment
later. Between the two, any other process may take the port: the torchrun jobs of the
other notebooks open TCPStores and gloo pairs on ephemeral ports all the time. On the
H100 run of 2026-11-28 (9 papermill notebooks beside 9 nbval workers) one kernel died
with ``ZMQError: Address already in use`` and its notebook failed after 60 s without
running a cell. With ``ipc`` the "ports" are files beside the connection file, whose
name is unique, so no other process can hold them.

    pm.execute_notebook(..., kernel_manager_class=kernels.ipc_manager())   # papermill
    pytest -p course_lib.grading.kernels solutions/00_launch.ipynb         # nbval
"""
from __future__ import annotations

import functools
import os
import tempfile
import uuid


@functools.cache
def ipc_manager(base=None):
    """A subclass of ``base`` (default: nbclient's ``AsyncKernelManager``) whose kernels
    use the ``ipc`` transport; an explicit ``transport=`` or config still wins."""
    from traitlets import default

    if base is None:
        from jupyter_client.manager import AsyncKernelManager as base

    class IPCKernelManager(base):
        @default("transport")
        def _transport_default(self):
            return "ipc"

        @default("ip")
        def _ip_default(self):
            # an absolute prefix: jupyter_client's own default may be the relative
            # "kernel-ipc", which the kernel (started in the notebook's folder) and the
            # client (in ours) would find in different places
            if self.connection_file:
                return os.path.splitext(os.path.abspath(self.connection_file))[0] + "-ipc"
            return os.path.join(tempfile.gettempdir(), f"kernel-{uuid.uuid4().hex}-ipc")

    IPCKernelManager.__name__ = IPCKernelManager.__qualname__ = f"IPC{base.__name__}"
    return IPCKernelManager


def pytest_configure(config):
    """As a pytest plugin (``-p course_lib.grading.kernels``): nbval's kernels use ipc."""
    try:
        import nbval.kernel
    except ImportError:  # nbval is not installed: nothing starts a kernel here
        return
    nbval.kernel.KernelManager = ipc_manager(nbval.kernel.KernelManager)
