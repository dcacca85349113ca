"""The launcher's sturdiness: concurrent launches, stray grandchildren, clean-up
failures, and what ranks send back."""
import collections
import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value, stray_processes
from course_lib import LaunchError, run, run_script, shutdown
from course_lib.runtime import procs
from course_lib.runtime.rank_io import map_tensors

ship_by_value(__name__)


# two processes launching jobs over and over (~30 s): `make test-slow`, which CI runs
@pytest.mark.slow
def test_two_notebooks_launching_at_once_never_collide(tmp_path):
    """No probe-then-bind: each rendezvous binds port 0 itself."""
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent("""
        import torch.distributed as dist
        from course_lib import run
        for i in range(5):  # one rank is enough: the race is the rendezvous port
            assert run(dist.get_rank, nproc=1, timeout=120) == [0], i
        print("FIVE OK")
    """))
    env = {**os.environ, "COURSE_LIB_WARM": "0"}  # five real launches each, side by side
    kernels = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
               for _ in range(2)]
    for k in kernels:
        out, err = k.communicate(timeout=600)
        assert k.returncode == 0 and "FIVE OK" in out, err[-3000:]


def leaves_a_grandchild(value):
    # a DataLoader worker or a helper a student started, holding the output pipe
    subprocess.Popen(["sleep", "60"])
    return value * dist.get_rank()


def test_a_grandchild_holding_the_pipe_does_not_turn_success_into_a_timeout():
    assert run(leaves_a_grandchild, 7, nproc=2, timeout=30) == [0, 7]
    shutdown()  # the grandchildren belong to the job and go with it
    assert not stray_processes()


@pytest.mark.slow
def test_a_script_leaving_a_grandchild_still_returns(tmp_path):
    script = tmp_path / "spawner.py"
    script.write_text("import subprocess\nsubprocess.Popen(['sleep', '60'])\nprint('spawned')\n")
    assert run_script(script, nproc=2, timeout=30) == [None, None]
    assert not stray_processes()


@pytest.mark.slow
def test_a_failing_clean_up_does_not_hide_the_ranks_error(monkeypatch):
    # no warm job of an earlier test may reach the patched kill from its idle timer's thread
    shutdown()
    real_kill = procs.kill_job

    def kill_then_complain(proc, job_id, timeout=10.0):
        real_kill(proc, job_id, timeout)
        raise RuntimeError("a process survived (simulated)")

    monkeypatch.setattr(procs, "kill_job", kill_then_complain)
    with pytest.raises(LaunchError) as info:
        run(divmod, 1, 0, nproc=2)
    assert info.value.exc_type == "ZeroDivisionError"
    assert any("simulated" in note for note in getattr(info.value, "__notes__", []))


Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Box:
    weights: torch.Tensor
    label: str
    extra: list


def test_tensors_are_mapped_in_any_nesting_and_containers_keep_their_type():
    value = {"state": collections.OrderedDict(w=torch.ones(2), b=torch.zeros(1)),
             "pair": Pair(torch.ones(1), [torch.ones(1), 3]),
             "box": Box(torch.ones(3), "x", [torch.ones(1)]), "n": 5}
    doubled = map_tensors(lambda t: t * 2, value)
    assert type(doubled["state"]) is collections.OrderedDict
    assert list(doubled["state"]) == ["w", "b"] and torch.equal(doubled["state"]["w"], 2 * torch.ones(2))
    assert type(doubled["pair"]) is Pair and torch.equal(doubled["pair"].left, torch.full((1,), 2.0))
    assert doubled["pair"].right[1] == 3
    assert type(doubled["box"]) is Box and doubled["box"].label == "x"
    assert torch.equal(doubled["box"].weights, torch.full((3,), 2.0))
    assert torch.equal(doubled["box"].extra[0], torch.full((1,), 2.0))
    assert doubled["n"] == 5


def state_of_a_layer():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    return layer.state_dict(), Pair(dist.get_rank(), torch.ones(1, requires_grad=True) * 2)


def test_results_keep_their_structure_across_the_process_boundary():
    state, pair = run(state_of_a_layer, nproc=2)[1]
    assert type(state) is collections.OrderedDict and list(state) == ["weight", "bias"]
    assert type(pair) is Pair and pair.left == 1 and not pair.right.requires_grad


class Agreeable(torch.Tensor):
    """A subclass whose every torch function answers True (a grading tamper)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return True


def test_a_tensor_subclass_that_answers_for_torch_is_refused_by_name():
    from course_lib.runtime.rank_io import to_cpu

    assert to_cpu({"w": torch.nn.Parameter(torch.ones(2))})["w"].tolist() == [1.0, 1.0]
    with pytest.raises(TypeError, match="Agreeable, a subclass of torch.Tensor"):
        to_cpu([torch.zeros(3).as_subclass(Agreeable)])


def _fork_server_and_agent():
    import psutil

    server = psutil.Process(os.getppid())
    return server.cmdline(), server.parent().cmdline(), server.parent().pid


def test_a_cpu_jobs_ranks_come_from_a_fork_of_its_agent_which_imported_torch_once():
    """The fork server is the agent forked once torch was imported (same command line),
    not a second interpreter importing torch again (multiprocessing's own)."""
    out = list(run(_fork_server_and_agent, nproc=2, backend="gloo", fresh=True))
    server, agent, agent_pid = out[0]
    assert out[1][2] == agent_pid  # both ranks forked by one server of one agent
    assert any(part.endswith("runtime/agent.py") for part in agent), agent
    assert server == agent, server


def _dynamo_imported():
    import sys

    return "torch._dynamo" in sys.modules


def test_ranks_beyond_twice_the_cores_are_forked_with_dynamo_imported():
    """torch._dynamo (a second of CPU, imported by the first optimizer a rank makes) is
    imported once by the fork server where the ranks would otherwise import it in turns,
    and left out where they would not (a job of collectives would wait for nothing)."""
    from course_lib.runtime.agent import preload

    cores = os.cpu_count() or 1
    if 2 * cores + 1 > 8:
        pytest.skip(f"{cores} cores: a job of {2 * cores + 1} ranks is too big for the suite")
    assert preload(2 * cores) == [] and preload(2 * cores + 1) == ["torch._dynamo"]
    assert not any(run(_dynamo_imported, nproc=1, backend="gloo", fresh=True))
    assert all(run(_dynamo_imported, nproc=2 * cores + 1, backend="gloo", fresh=True))
