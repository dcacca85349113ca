"""Warm ranks under real torchrun (gloo): reuse, isolation between calls, teardown."""
import importlib
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import settled, ship_by_value, stray_folders, stray_processes
from course_lib import LaunchError, LaunchTimeout, comm, run, shutdown, trace
from course_lib.runtime import warm

ship_by_value(__name__)


def pid_and_rank():
    return os.getpid(), dist.get_rank()


def pids(nproc=2, **kw):
    return [pid for pid, _ in run(pid_and_rank, nproc=nproc, timeout=60, **kw)]


def test_later_calls_reuse_the_same_ranks():
    first = pids()
    assert pids() == first and pids() == first
    assert pids(fresh=True) != first  # fresh=True: a brand-new job


@pytest.mark.slow
def test_fifty_warm_calls_in_a_row_are_correct():
    def summed(i):
        t = torch.tensor([float(dist.get_rank() + i)])
        dist.all_reduce(t)
        return t.item()

    for i in range(50):
        assert run(summed, i, nproc=3, timeout=60) == [3.0 + 3 * i] * 3, i


@pytest.mark.slow
def test_each_world_size_keeps_its_job_up_to_the_limit(monkeypatch):
    monkeypatch.setenv("COURSE_LIB_WARM_MAX", "2")
    shutdown()
    two, three = pids(nproc=2), pids(nproc=3)
    assert set(two).isdisjoint(three)
    assert pids(nproc=2) == two and pids(nproc=3) == three  # both stay warm
    pids(nproc=2)
    one = pids(nproc=1)  # a third size ends the least recently used: the 3-rank job
    assert len(warm.current_job_ids()) == 2
    assert not any(p.pid in three for p in stray_processes())
    assert pids(nproc=2) == two and pids(nproc=1) == one


@pytest.mark.slow
def test_one_warm_job_replaces_another_when_the_limit_is_one(monkeypatch):
    monkeypatch.setenv("COURSE_LIB_WARM_MAX", "1")
    two = pids(nproc=2)
    three = pids(nproc=3)
    assert set(two).isdisjoint(three) and len(warm.current_job_ids()) == 1
    assert not any(p.pid in two for p in stray_processes())


def test_turning_warm_ranks_off_stops_handing_out_the_kept_job(monkeypatch):
    """COURSE_LIB_WARM=0 set after a job was kept: the next call is a fresh job (its
    environment, its processes), not the kept one, and it is not kept either."""
    kept = pids()
    monkeypatch.setenv("COURSE_LIB_WARM", "0")
    off = pids()
    assert set(off).isdisjoint(kept) and set(pids()).isdisjoint(off)


def test_a_call_after_a_failure_uses_a_fresh_job():
    before = pids()
    with pytest.raises(LaunchError):
        run(divmod, 1, 0, nproc=2)
    after = pids()
    assert set(before).isdisjoint(after)


def ends_its_group():
    pid = os.getpid()
    dist.destroy_process_group()
    return pid


def test_a_call_that_ends_the_default_group_retires_its_ranks():
    """A call may end the job's default group (as torch's tutorials end their scripts);
    the ranks then serve no more, and the very next call starts a new job at once."""
    before = pids()
    ended = run(ends_its_group, nproc=2, timeout=60)
    assert ended == before
    after = pids()
    assert set(after).isdisjoint(ended) and pids() == after


def wait_for_nobody():
    dist.recv(torch.zeros(1), (dist.get_rank() + 1) % dist.get_world_size())


@pytest.mark.slow
def test_a_call_after_a_timeout_uses_a_fresh_job():
    before = pids()
    with pytest.raises(LaunchTimeout) as info:
        run(wait_for_nobody, nproc=2, timeout=5)
    assert sorted(info.value.stacks) == [0, 1]
    assert "wait_for_nobody" in info.value.stacks[0]
    after = pids()
    assert set(before).isdisjoint(after)


@pytest.mark.slow
def test_a_call_after_an_interrupt_uses_a_fresh_job(interruptible):
    before = pids()

    def interrupt_soon():
        time.sleep(2)
        os.kill(os.getpid(), __import__("signal").SIGINT)

    threading.Thread(target=interrupt_soon, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run(time.sleep, 30, nproc=2, timeout=60)
    assert not any(p.pid in before for p in stray_processes())
    assert set(before).isdisjoint(pids())


def test_shutdown_ends_every_process_of_the_job():
    shutdown()  # earlier tests of the session may have left jobs of other sizes warm
    pids(nproc=2)
    pids(nproc=3)
    assert len(warm.current_job_ids()) == 2
    shutdown()
    assert warm.current_job_ids() == set() and not stray_processes()


def test_a_job_started_from_a_helper_thread_outlives_the_thread():
    """A job started from a thread must not die when that thread ends (the trap
    of PR_SET_PDEATHSIG, which follows the thread, not the process)."""
    shutdown()
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("pids", pids()))
    worker.start()
    worker.join()
    time.sleep(1.0)
    assert pids() == box["pids"]


# ---- isolation: a call changes something, the next call must not see it -----------
def tf32_flags(modules=False):
    """torch's TF32 switches (imported by name: cloudpickle cannot ship the cudnn module)."""
    matmul = importlib.import_module("torch.backends.cuda").matmul
    cudnn = importlib.import_module("torch.backends.cudnn")
    return (matmul, cudnn) if modules else (matmul.allow_tf32, cudnn.allow_tf32)


def isolation_probe(change):
    """Report the state a call starts in; then, with ``change``, alter it."""
    seen = {
        "dtype": str(torch.get_default_dtype()),
        "device": str(torch.empty(0).device),
        "torch_rng": torch.rand(3).tolist(),
        "numpy_rng": np.random.rand(3).tolist(),
        "random_rng": [random.random() for _ in range(3)],
        "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "groups": len(dist.distributed_c10d._world.pg_map),
        "counting": len(comm._active),
        "tracer_spans": len(trace.get_tracer()._spans) if trace.get_tracer() else None,
        "cwd": os.getcwd(),
        "argv": list(sys.argv),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "tf32": tf32_flags(),
    }
    if change:
        dist.new_group([0, 1])
        torch.set_default_dtype(torch.float64)
        torch.set_default_device("meta")
        torch.rand(100)
        np.random.rand(100)
        random.random()
        torch.set_grad_enabled(False)
        torch.use_deterministic_algorithms(True)
        comm.counting().__enter__()  # a counter left open
        with trace.span("left behind"):
            pass
        os.chdir("/")
        sys.argv.append("--extra")
        torch.set_float32_matmul_precision("medium")
        matmul, cudnn = tf32_flags(modules=True)
        matmul.allow_tf32, cudnn.allow_tf32 = not matmul.allow_tf32, not cudnn.allow_tf32
    return seen


@pytest.mark.parametrize("item", ["dtype", "device", "torch_rng", "numpy_rng", "random_rng",
                                  "grad", "deterministic", "groups", "counting",
                                  "tracer_spans", "cwd", "argv", "matmul_precision", "tf32"])
def test_a_call_does_not_see_what_the_previous_call_changed(item):
    first = run(isolation_probe, True, nproc=2, timeout=60)
    second = run(isolation_probe, False, nproc=2, timeout=60)
    for rank in range(2):
        assert second[rank][item] == first[rank][item], (item, rank)
    if item == "cwd":
        assert first[0]["cwd"] == os.getcwd()  # the notebook's folder, as a fresh job's


def test_each_call_starts_in_the_notebooks_current_folder(tmp_path, monkeypatch):
    run(os.getcwd, nproc=2)
    monkeypatch.chdir(tmp_path)
    assert run(os.getcwd, nproc=2) == [str(tmp_path)] * 2


# ---- the job ends with the kernel ---------------------------------------------------
def run_kernel(tmp_path, body, env=None):
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, **(env or {})})


def wait_until_gone(ranks, limit_s=20):
    """Wait until the other kernel's job (its ranks, torchrun, anything they
    started) has gone; return what is still there."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        alive = stray_processes()
        if not alive:
            return []
        time.sleep(0.2)
    return [(p.pid, p.pid in ranks) for p in alive]


@pytest.mark.slow
def test_the_job_ends_when_the_interpreter_exits(tmp_path):
    proc = run_kernel(tmp_path, """
        import os
        from course_lib import run
        print("PIDS", run(os.getpid, nproc=2))
    """)
    assert proc.returncode == 0, proc.stderr
    left = eval(proc.stdout.split("PIDS", 1)[1].strip())
    assert not wait_until_gone(left)


def launched_by(folder, pid):
    try:
        return json.loads((folder / "spec.json").read_text())["launcher_pid"] == pid
    except (OSError, ValueError):
        return False


@pytest.mark.slow
def test_an_idle_job_ends_by_itself(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, time
        from course_lib import run
        print("PIDS", run(os.getpid, nproc=2), flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "COURSE_LIB_WARM_IDLE_S": "2"})
    try:
        line = proc.stdout.readline()
        ranks = eval(line.split("PIDS", 1)[1].strip())
        assert not wait_until_gone(ranks, limit_s=30)
        assert proc.poll() is None  # the kernel is still there; only its job left
        assert not settled(lambda: [f for f in stray_folders() if launched_by(f, proc.pid)], 10)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_job_started_from_a_thread_still_dies_with_the_kernel(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, threading, time
        from course_lib import run
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("p", run(os.getpid, nproc=2)))
        t.start(); t.join()
        print("PIDS", box["p"], flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        ranks = eval(proc.stdout.readline().split("PIDS", 1)[1].strip())
        time.sleep(1.5)
        assert any(p.pid in ranks for p in stray_processes())  # alive after the thread ended
    finally:
        proc.kill()
        proc.wait()
    assert not wait_until_gone(ranks)


@pytest.mark.slow
def test_warm_ranks_can_be_turned_off(monkeypatch):
    shutdown()  # jobs earlier tests left warm
    monkeypatch.setenv("COURSE_LIB_WARM", "0")
    first, second = pids(), pids()
    assert set(first).isdisjoint(second)
    assert not warm.current_job_ids() and not stray_processes()


@pytest.mark.slow
def test_two_kernels_keep_their_own_jobs(tmp_path):
    body = """
        import os, sys, torch, torch.distributed as dist
        from course_lib import run
        tag = float(sys.argv[1])
        def f(x):
            t = torch.tensor([x + dist.get_rank()])
            dist.all_reduce(t)
            return t.item()
        for i in range(15):
            assert run(f, tag + i, nproc=2) == [2 * (tag + i) + 1] * 2
        print("OK", tag)
    """
    script = tmp_path / "k.py"
    script.write_text(textwrap.dedent(body))
    kernels = [subprocess.Popen([sys.executable, str(script), str(t)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=tmp_path)
               for t in (100, 200)]
    outs = [k.communicate(timeout=180) for k in kernels]
    for k, (out, err) in zip(kernels, outs):
        assert k.returncode == 0, err[-2000:]
    assert "OK 100.0" in outs[0][0] and "OK 200.0" in outs[1][0]
