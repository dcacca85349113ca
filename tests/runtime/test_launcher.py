"""The launcher under real torchrun with gloo: results, failures, hangs, cleanup."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value, stray_processes
from course_lib import LaunchError, LaunchTimeout, run, run_cell, run_script

ship_by_value(__name__)
OFFSET = 100  # a module global the ranks must see


def rank_info(scale):
    return {"rank": dist.get_rank(), "world": dist.get_world_size(),
            "local_rank": int(os.environ["LOCAL_RANK"]), "backend": dist.get_backend(),
            "value": torch.full((3,), float(dist.get_rank() * scale + OFFSET))}


def test_results_indexed_by_rank_with_args_and_globals():
    out = run(rank_info, 2.0, nproc=3)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert {o["world"] for o in out} == {3}
    assert [o["local_rank"] for o in out] == [0, 1, 2]
    assert {o["backend"] for o in out} == {"gloo"}
    for r, o in enumerate(out):
        torch.testing.assert_close(o["value"], torch.full((3,), r * 2.0 + OFFSET))
    assert out.backend == "gloo" and out.wall_time > 0


def test_kwargs_and_collective_inside():
    def summed(base, *, extra):
        t = torch.tensor([float(dist.get_rank() + base + extra)])
        dist.all_reduce(t)
        return t.item()

    assert run(summed, 1, extra=10, nproc=3) == [36.0] * 3  # (0+1+2) + 3*11


def test_function_defined_in_a_real_main_module(tmp_path):
    """What a notebook does: a function in __main__ using a __main__ global."""
    script = tmp_path / "nb.py"
    script.write_text(textwrap.dedent("""
        import torch.distributed as dist
        from course_lib import run
        FACTOR = 7
        def scaled_rank():
            return dist.get_rank() * FACTOR
        if __name__ == "__main__":
            print("RESULT", run(scaled_rank, nproc=2))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [0, 7]" in proc.stdout


def test_output_is_streamed_with_rank_prefix(capsys):
    def chatty():
        print(f"hello from {dist.get_rank()}")
        print("no newline at the end", end="")

    run(chatty, nproc=2)
    out = capsys.readouterr().out
    assert "[rank0] hello from 0" in out and "[rank1] hello from 1" in out
    assert "[rank1] no newline at the end" in out


def test_one_rank_raising_gives_its_traceback():
    def fails_on_one():
        if dist.get_rank() == 1:
            raise ValueError("rank one is unhappy")
        dist.barrier()  # the others wait for it and are torn down

    with pytest.raises(LaunchError) as info:
        run(fails_on_one, nproc=3, timeout=60)
    err = info.value
    assert not isinstance(err, LaunchTimeout)
    assert 1 in err.ranks and err.exc_type == "ValueError"
    assert "rank one is unhappy" in str(err) and "fails_on_one" in str(err)
    assert str(err).startswith("rank 1 failed")


def wait_for_left_neighbour():
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.zeros(4)
    dist.recv(t, (rank - 1) % world)  # nobody ever sends


def test_deadlock_ends_in_timeout_with_every_stack():
    started = time.perf_counter()
    with pytest.raises(LaunchTimeout) as info:
        run(wait_for_left_neighbour, nproc=3, timeout=8)
    elapsed = time.perf_counter() - started
    err = info.value
    assert sorted(err.stacks) == [0, 1, 2] and err.ranks == [0, 1, 2]
    for rank in range(3):
        assert "wait_for_left_neighbour" in err.stacks[rank]
        assert f"--- rank {rank} ---" in str(err)
    assert "runtime/worker.py" not in str(err)  # launcher frames are trimmed
    assert elapsed < 8 + 30  # bounded: the timeout plus stack collection and cleanup


def test_invalid_requests_fail_before_starting():
    before = time.perf_counter()
    with pytest.raises(ValueError, match="unknown backend"):
        run(rank_info, 1, nproc=2, backend="carrier-pigeon")
    with pytest.raises(ValueError, match="positive integer"):
        run(rank_info, 1, nproc=0)
    with pytest.raises(ValueError, match="timeout"):
        run(rank_info, 1, nproc=2, timeout=0)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="NCCL|one GPU per rank"):
            run(rank_info, 1, nproc=64, backend="nccl")
    assert time.perf_counter() - before < 5  # nothing was launched


def port_is_free(port):
    """Can a new server listen on ``port``? (SO_REUSEADDR, as torchrun's store sets
    it: connections the killed job leaves in TIME_WAIT do not hold a port.)"""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            return True
        except OSError:
            return False


def test_launches_in_a_row_free_their_ports(monkeypatch):
    monkeypatch.setenv("COURSE_LIB_WARM", "0")  # every call a job of its own, ended after it
    ports = []
    for i in range(5):
        out = run(dist.get_rank, nproc=2, timeout=60)
        assert out == [0, 1], i
        assert port_is_free(out.port), f"launch {i}: port {out.port} still bound"
        ports.append(out.port)
    assert len(set(ports)) > 1  # a fresh port per launch


def test_rendezvous_port_is_free_after_failure_and_timeout():
    with pytest.raises(LaunchTimeout) as info:
        run(wait_for_left_neighbour, nproc=2, timeout=5)
    assert info.value.port and port_is_free(info.value.port)
    with pytest.raises(LaunchError) as info:
        run(divmod, 1, 0, nproc=2)
    assert info.value.exc_type == "ZeroDivisionError" and port_is_free(info.value.port)


def test_run_cell_executes_source_on_every_rank(capsys):
    src = "t = torch.tensor([float(rank)]); dist.all_reduce(t); print('sum', t.item(), world_size)"
    run_cell(src, {"torch": torch, "dist": dist}, nproc=3)
    out = capsys.readouterr().out
    for r in range(3):
        assert f"[rank{r}] sum 3.0 3" in out


def test_run_script_passes_argv_and_reports_failure(tmp_path, capsys):
    good = tmp_path / "good.py"
    good.write_text(textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from course_lib.runtime.backend import init_distributed
        init_distributed()
        t = torch.ones(1); dist.all_reduce(t)
        print("args", sys.argv[1:], "sum", int(t.item()))
        dist.destroy_process_group()
    """))
    assert run_script(good, "--lr", 3, nproc=2) == [None, None]
    assert "[rank1] args ['--lr', '3'] sum 2" in capsys.readouterr().out

    bad = tmp_path / "bad.py"
    bad.write_text("import os\nif os.environ['RANK'] == '1':\n    raise KeyError('missing')\n")
    with pytest.raises(LaunchError) as info:
        run_script(bad, nproc=2)
    assert info.value.ranks == [1] and "KeyError" in str(info.value)
    with pytest.raises(FileNotFoundError):
        run_script(tmp_path / "nope.py")


def test_keyboard_interrupt_kills_the_job():
    def sleepy():
        time.sleep(60)

    def interrupt_soon():
        time.sleep(6)
        os.kill(os.getpid(), signal.SIGINT)

    import threading

    threading.Thread(target=interrupt_soon, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run(sleepy, nproc=2, timeout=120)
    assert not stray_processes()


def test_dead_kernel_takes_its_job_with_it(tmp_path):
    """A kernel killed with SIGKILL (a restart) must not leave ranks running."""
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent("""
        import time
        from course_lib import run
        def forever():
            print("started", flush=True)
            time.sleep(600)
        run(forever, nproc=2, timeout=600)
    """))
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=tmp_path)
    try:
        for line in kernel.stdout:  # wait until the ranks really run
            if "started" in line:
                break
        assert stray_processes()
    finally:
        kernel.kill()
        kernel.wait()
    deadline = time.time() + 20
    while stray_processes() and time.time() < deadline:
        time.sleep(0.2)
    assert not stray_processes()
