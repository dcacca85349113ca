"""The %%torchrun cell magic in a real IPython shell."""
import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell

from course_lib import LaunchError
from course_lib.runtime.magic import shippable_namespace


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "course_lib")
    yield ip
    InteractiveShell.clear_instance()


def test_cell_runs_on_every_rank_with_notebook_functions(shell, capsys):
    shell.run_cell("import torch\nOFFSET = 40\ndef bump(x):\n    return x + OFFSET\nNPROC = 3",
                   store_history=False)
    shell.run_cell_magic("torchrun", "-n {NPROC} --timeout 60",
                         "t = torch.tensor([float(bump(rank))])\n"
                         "dist.all_reduce(t)\nprint('total', int(t.item()), world_size, device)")
    out = capsys.readouterr().out
    for r in range(3):
        assert f"[rank{r}] total 123 3 cpu" in out  # (40 + 41 + 42)


def test_failing_cell_raises_launch_error(shell):
    with pytest.raises(LaunchError, match="ZeroDivisionError"):
        shell.run_cell_magic("torchrun", "-n 2", "x = 1 / (rank - 1)")


def test_bad_arguments_are_explained(shell):
    with pytest.raises(ValueError, match="usage: %%torchrun"):
        shell.run_cell_magic("torchrun", "--bogus", "pass")


def test_shippable_namespace_keeps_what_can_travel():
    class Local:
        pass

    Local.__module__ = "__main__"
    ns = {"_hidden": 1, "In": [], "n": 3, "name": "x", "t": torch.ones(2), "torch": torch,
          "Local": Local, "gen": (i for i in range(3)), "cfg": {"lr": 0.1}, "big": list(range(5000))}
    kept = shippable_namespace(ns)
    assert set(kept) == {"n", "name", "t", "torch", "Local", "cfg"}
