"""Kernels on Unix sockets: a notebook runs through one, and nbval's plugin swaps its manager."""
import nbformat
from nbclient import NotebookClient

from course_lib.grading import kernels

ASK_THE_KERNEL = """\
from ipykernel.kernelapp import IPKernelApp
app = IPKernelApp.instance()
print(6 * 7, app.transport, app.ip.startswith("/"))"""


def test_a_notebook_runs_on_an_ipc_kernel(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(ASK_THE_KERNEL)])
    # the kernel runs in tmp_path, this process elsewhere: the socket files need a path
    # both find (jupyter_client's own default, "kernel-ipc", is relative)
    NotebookClient(nb, timeout=60, kernel_name="python3",
                   kernel_manager_class=kernels.ipc_manager(),
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert nb.cells[0].outputs[0]["text"] == "42 ipc True\n"


def test_an_explicit_transport_still_wins():
    assert kernels.ipc_manager()(transport="tcp").transport == "tcp"
    assert kernels.ipc_manager()().transport == "ipc"


def test_the_pytest_plugin_gives_nbval_ipc_kernels(monkeypatch):
    import nbval.kernel

    monkeypatch.setattr(nbval.kernel, "KernelManager", nbval.kernel.KernelManager)
    kernels.pytest_configure(None)
    assert nbval.kernel.KernelManager().transport == "ipc"
