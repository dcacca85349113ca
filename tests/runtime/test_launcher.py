"""The launcher under real torchrun with gloo: results, failures, hangs, cleanup."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value, stray_processes
import course_lib
from course_lib import LaunchError, LaunchTimeout, comm, run, run_cell, run_script
from course_lib.runtime.hangs import diagnose_hang
from course_lib.runtime.stacks import trim_stack

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


@pytest.mark.slow
class Tripled(torch.autograd.Function):
    """A notebook's autograd Function with torch's @once_differentiable on its backward."""

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return grad * 3 * (dist.get_rank() + 1)


def tripled_gradient():
    x = torch.ones(2, requires_grad=True)
    Tripled.apply(x).sum().backward()
    return x.grad.tolist()


def test_an_autograd_function_with_a_once_differentiable_backward_reaches_the_ranks():
    """cloudpickle alone ships the decorator's wrapper as code, with torch's C autograd
    module by value, and the rank cannot rebuild it (AccumulateGrad has no attribute
    '_input_metadata')."""
    assert run(tripled_gradient, nproc=2, timeout=60) == [[3.0, 3.0], [6.0, 6.0]]


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


@pytest.mark.slow  # a hang waited out: `make test-slow`
def test_deadlock_ends_in_timeout_with_every_stack():
    run(int, nproc=3)  # start the job first: the short timeout is for the hang alone
    started = time.perf_counter()
    with pytest.raises(LaunchTimeout) as info:
        run(wait_for_left_neighbour, nproc=3, timeout=8)
    elapsed = time.perf_counter() - started
    err = info.value
    assert sorted(err.stacks) == [0, 1, 2] and err.ranks == [0, 1, 2]
    for rank in range(3):
        assert "wait_for_left_neighbour" in err.stacks[rank]
        assert "runtime/worker.py" in err.stacks[rank]  # .stacks: the untrimmed dumps
        assert f"--- rank {rank} ---" in str(err)
    assert "runtime/worker.py" not in str(err)  # launcher frames are trimmed
    assert "threading.py" not in str(err)  # so are helper threads
    assert err.diagnosis.kind == "p2p"
    assert "ranks 0, 1 and 2 all wait in recv() and no rank is sending" in str(err)
    # each rank's stack starts at the student's frame, with its line of code
    block = str(err).split("--- rank 1 ---\n")[1].splitlines()
    assert block[0].endswith(", in wait_for_left_neighbour")
    assert block[1] == "    dist.recv(t, (rank - 1) % world)  # nobody ever sends"
    assert elapsed < 8 + 30  # bounded: the timeout plus stack collection and cleanup


def wait_on_an_irecv():
    peer = (dist.get_rank() + 1) % dist.get_world_size()
    comm.irecv(torch.zeros(2), peer).wait()  # traced: a helper thread waits on the work


@pytest.mark.slow
def test_timeout_stacks_leave_out_the_helper_threads():
    run(int, nproc=2)  # start the job first: the short timeout is for the hang alone
    with pytest.raises(LaunchTimeout) as info:
        run(wait_on_an_irecv, nproc=2, timeout=5)
    err = info.value
    assert all("_complete_when_done" in err.stacks[r] for r in (0, 1))  # it was there...
    assert "_complete_when_done" not in str(err) and "concurrent/futures" not in str(err)
    block = str(err).split("--- rank 0 ---\n")[1].split("--- rank 1 ---")[0]
    assert block.splitlines()[0].endswith(", in wait_on_an_irecv")
    assert 'File "course_lib/handle.py"' in block and ", in wait" in block
    assert err.diagnosis.kind == "p2p"
    assert err.diagnosis.ranks[0].detail == "on an isend/irecv"


# ---- reading the stacks of a hung job, without processes --------------------------------
PKG = Path(course_lib.__file__).resolve().parent
TORCH = Path(torch.__file__).resolve().parent
STDLIB = Path(threading.__file__).resolve().parent
CELL = "/tmp/ipykernel_4242/3141592653.py"  # a notebook cell, as the kernel names it
SOURCE = {(CELL, 4): "comm.recv(buf, (rank - 1) % world)",
          (CELL, 6): "dist.all_reduce(x)",
          (CELL, 8): "dist.broadcast(x, src=0)",
          (CELL, 10): "dist.barrier()",
          (CELL, 12): "loss.backward()"}


def getline(file, line):
    return SOURCE.get((file, line), "")


def frame(path, line, func):
    return f'  File "{path}", line {line} in {func}'


def thread(frames, current=False, ident="0x00007f1a2b3c4d5e"):
    """A thread of a faulthandler dump; ``frames`` innermost first, as it writes them."""
    head = f"{'Current thread' if current else 'Thread'} {ident} (most recent call first):"
    return "\n".join([head, *frames])


def dump(*threads):
    return "\n\n".join(threads) + "\n"


C10D, LOGGER = f"{TORCH}/distributed/distributed_c10d.py", f"{TORCH}/distributed/c10d_logger.py"
WORKER = f"{PKG}/runtime/worker.py"
SERVING = [frame(WORKER, 138, "_run_call"), frame(WORKER, 176, "_serve"),
           frame(WORKER, 206, "main"), frame(WORKER, 230, "<module>"),
           frame("<frozen runpy>", 88, "_run_code"),
           frame("<frozen runpy>", 198, "_run_module_as_main")]
BOOT = [frame(f"{STDLIB}/threading.py", 982, "run"),
        frame(f"{STDLIB}/threading.py", 1045, "_bootstrap_inner"),
        frame(f"{STDLIB}/threading.py", 1002, "_bootstrap")]
POOL = [frame(f"{STDLIB}/concurrent/futures/thread.py", 58, "run"),
        frame(f"{STDLIB}/concurrent/futures/thread.py", 83, "_worker"), *BOOT]
WATCHER = thread([frame(WORKER, 74, "_watch_launcher"), *BOOT], ident="0x00007f0000000001")
IDLE_POOL = thread([frame(f"{STDLIB}/concurrent/futures/thread.py", 81, "_worker"), *BOOT],
                   ident="0x00007f0000000002")
P2P_WAITER = thread([frame(f"{PKG}/handle.py", 173, "_complete_when_done"), *POOL],
                    ident="0x00007f0000000003")
TORCH_CALL = {op: [frame(C10D, line, op), frame(LOGGER, 83, "wrapper")] for op, line in
              [("recv", 2799), ("send", 2753), ("all_reduce", 3252), ("broadcast", 3151),
               ("barrier", 5356)]}
COMM_RECV = [*TORCH_CALL["recv"], frame(f"{PKG}/comm.py", 119, "recv")]
OUR_ALL_REDUCE = [frame(f"{TORCH}/futures/__init__.py", 80, "wait"),
                  frame(f"{PKG}/handle.py", 147, "wait"), frame(f"{PKG}/comm.py", 174, "exchange"),
                  frame(f"{PKG}/collectives/ring.py", 163, "_stepwise"),
                  frame(f"{PKG}/collectives/ring.py", 125, "_ring_collective"),
                  frame(f"{PKG}/collectives/ring.py", 204, "_all_reduce"),
                  frame(f"{PKG}/collectives/ring.py", 184, "_maybe_async"),
                  frame(f"{PKG}/collectives/ring.py", 193, "all_reduce")]
IDLE = [frame(WORKER, 170, "_serve"), *SERVING[2:]]


def rank_in(*frames, helpers=(WATCHER,)):
    """A serving rank whose current call is ``frames`` (innermost first)."""
    return dump(*helpers, thread([*frames, *SERVING], current=True))


def test_trimmed_stack_starts_at_the_students_code_and_ends_in_the_call_it_waits_in():
    text = dump(WATCHER, P2P_WAITER, IDLE_POOL, thread(
        [*COMM_RECV, frame(CELL, 4, "ring_step"), frame(CELL, 20, "ring_all_reduce"),
         frame(f"{PKG}/grading/lab00/__init__.py", 17, "counted"), *SERVING], current=True))
    assert trim_stack(text, getline) == "\n".join([
        f'  File "{CELL}", line 20, in ring_all_reduce',
        f'  File "{CELL}", line 4, in ring_step',
        "    comm.recv(buf, (rank - 1) % world)",
        '  File "course_lib/comm.py", line 119, in recv',
        "  ...",
        '  File "torch/distributed/distributed_c10d.py", line 2799, in recv'])


def test_trimmed_stack_keeps_a_thread_the_student_started_and_library_frames_between():
    mine = thread([*TORCH_CALL["barrier"], frame(CELL, 10, "background"), *BOOT])
    backward = [frame(f"{TORCH}/autograd/graph.py", 825, "_engine_run_backward"),
                frame(f"{TORCH}/autograd/__init__.py", 353, "backward"),
                frame(f"{TORCH}/_tensor.py", 648, "backward")]
    text = dump(WATCHER, mine, thread(
        [*TORCH_CALL["all_reduce"], frame(CELL, 6, "hook"), *backward,
         frame(CELL, 12, "train_step"), *SERVING], current=True))
    shown = trim_stack(text, getline).splitlines()
    assert shown[:4] == [f'  File "{CELL}", line 12, in train_step', "    loss.backward()",
                         '  File "torch/_tensor.py", line 648, in backward',
                         '  File "torch/autograd/__init__.py", line 353, in backward']
    assert shown[4:8] == [
        '  File "torch/autograd/graph.py", line 825, in _engine_run_backward',
        f'  File "{CELL}", line 6, in hook', "    dist.all_reduce(x)",
        '  File "torch/distributed/distributed_c10d.py", line 3252, in all_reduce']
    assert shown[8:11] == ["  another thread of this rank:",
                           f'  File "{CELL}", line 10, in background', "    dist.barrier()"]
    assert not any("worker.py" in ln or "threading.py" in ln or "_watch_launcher" in ln
                   for ln in shown)


def test_hang_in_recv_on_every_rank_is_a_p2p_hang():
    stack = rank_in(*COMM_RECV, frame(CELL, 4, "ring_step"))
    diag = diagnose_hang({0: stack, 1: stack}, 2, getline)
    assert diag.kind == "p2p"
    assert diag.hint.startswith("ranks 0 and 1 both wait in recv() and no rank is sending.")
    assert "Look for a send or recv that no other rank matches" in diag.hint
    assert diag.summary() == ("  ranks 0 and 1 wait in recv() (course_lib.comm) at ring_step, "
                              "line 4: comm.recv(buf, (rank - 1) % world)")
    state = diag.ranks[1]
    assert (state.status, state.op, state.kind, state.library) == \
        ("blocked", "recv", "p2p", "course_lib.comm")


def test_hang_in_send_on_every_rank_says_nobody_receives():
    stack = rank_in(*TORCH_CALL["send"], frame(CELL, 3, "shift"))
    diag = diagnose_hang({0: stack, 1: stack, 2: stack}, 3, getline)
    assert diag.kind == "p2p"
    assert diag.hint.startswith("ranks 0, 1 and 2 all wait in send() and no rank is receiving")


def test_ranks_in_different_collectives_are_named_with_their_collective():
    reduce = rank_in(*TORCH_CALL["all_reduce"], frame(CELL, 6, "mismatched"))
    bcast = rank_in(*TORCH_CALL["broadcast"], frame(CELL, 8, "mismatched"))
    diag = diagnose_hang({0: reduce, 1: bcast, 2: bcast}, 3, getline)
    assert diag.kind == "mismatched-collectives"
    assert diag.hint.startswith("the ranks are stuck in different collectives: rank 0 in "
                                "all_reduce(), ranks 1 and 2 in broadcast().")
    assert "same collectives in the same order" in diag.hint
    assert "send or recv" not in diag.hint
    assert "  rank 0 waits in all_reduce() (torch.distributed) at mismatched, line 6: " \
           "dist.all_reduce(x)" in diag.summary()


def test_a_rank_that_returned_is_missing_from_the_collective():
    barrier = rank_in(*TORCH_CALL["barrier"], frame(CELL, 10, "early_return"))
    diag = diagnose_hang({0: barrier, 1: dump(WATCHER, thread(IDLE, current=True)),
                          2: barrier}, 3, getline)
    assert diag.kind == "missing-from-collective"
    assert diag.hint.startswith("ranks 0 and 2 wait in barrier(), which rank 1 never joined "
                                "(rank 1 had already returned from your function).")
    assert diag.ranks[1].status == "finished"
    # a rank with no stack at all had exited
    diag = diagnose_hang({0: barrier, 1: barrier}, 3, getline)
    assert diag.kind == "missing-from-collective"
    assert "which rank 2 never joined (rank 2 had exited (no stack))" in diag.hint


def test_a_rank_in_another_kind_of_call_is_missing_from_the_collective():
    diag = diagnose_hang({0: rank_in(*COMM_RECV, frame(CELL, 4, "f")),
                          1: rank_in(*TORCH_CALL["barrier"], frame(CELL, 10, "f"))}, 2, getline)
    assert diag.kind == "missing-from-collective"
    assert diag.hint.startswith("rank 1 waits in barrier(), which rank 0 never joined "
                                "(rank 0 is in recv()).")


def test_our_collectives_count_as_collectives_not_as_their_messages():
    diag = diagnose_hang({0: rank_in(*OUR_ALL_REDUCE, frame(CELL, 6, "f"), helpers=(
        WATCHER, P2P_WAITER)), 1: dump(thread(IDLE, current=True))}, 2, getline)
    state = diag.ranks[0]
    assert (state.op, state.kind, state.library) == \
        ("all_reduce", "collective", "course_lib.collectives")
    assert diag.kind == "missing-from-collective"
    assert diag.ranks[0].stack.splitlines() == [
        f'  File "{CELL}", line 6, in f', "    dist.all_reduce(x)",
        '  File "course_lib/collectives/ring.py", line 193, in all_reduce', "  ...",
        '  File "torch/futures/__init__.py", line 80, in wait']


def test_a_wait_is_read_through_the_helper_threads():
    handle_wait = [frame(f"{TORCH}/futures/__init__.py", 80, "wait"),
                   frame(f"{PKG}/handle.py", 147, "wait"), frame(CELL, 14, "overlap")]
    lane = thread([*OUR_ALL_REDUCE[:6], frame(f"{PKG}/handle.py", 116, "body"), *POOL])
    on_collective = diagnose_hang({0: rank_in(*handle_wait, helpers=(WATCHER, lane)),
                                   1: rank_in(*TORCH_CALL["broadcast"], frame(CELL, 8, "g"))},
                                  2, getline)
    assert on_collective.kind == "mismatched-collectives"
    assert on_collective.ranks[0].op == "all_reduce"
    assert "rank 0 in all_reduce(), rank 1 in broadcast()" in on_collective.hint
    assert "body" not in on_collective.ranks[0].stack  # the helper thread is not shown
    on_message = diagnose_hang({r: rank_in(*handle_wait, helpers=(WATCHER, P2P_WAITER))
                                for r in (0, 1)}, 2, getline)
    assert on_message.kind == "p2p" and on_message.ranks[1].detail == "on an isend/irecv"
    assert "wait() for a message (an isend or irecv) that never completes" in on_message.hint


def test_the_checkers_own_collective_is_not_the_students():
    in_check = rank_in(*TORCH_CALL["all_reduce"],
                       frame(f"{PKG}/grading/lab01/jobs.py", 46, "all_reduce_job"))
    diag = diagnose_hang({0: in_check, 1: rank_in(*COMM_RECV, frame(CELL, 4, "naive"))},
                         2, getline)
    assert diag.kind == "p2p"
    assert diag.ranks[0].status == "in-check"
    assert diag.hint.startswith(
        "rank 1 waits in recv(), but rank 0 had left your function and is in the check's "
        "own all_reduce(): no rank will match it (one recv too many, or a send missing")
    assert diag.ranks[0].stack == (
        "  (this rank is outside your function, in the check's own all_reduce() "
        "(course_lib/grading/lab01/jobs.py, in all_reduce_job))")
    # the checker's broadcast against the student's all-reduce: the student's is missing a rank
    broadcast = rank_in(*TORCH_CALL["broadcast"],
                        frame(f"{PKG}/grading/lab02/jobs.py", 36, "broadcast_then"))
    diag = diagnose_hang({0: broadcast, 1: rank_in(*TORCH_CALL["all_reduce"],
                                                   frame(CELL, 6, "average"))}, 2, getline)
    assert diag.kind == "missing-from-collective"
    assert "rank 1 waits in all_reduce(), which rank 0 never joined (rank 0 had left your " \
           "function and is in the check's own broadcast())" in diag.hint


def test_the_checkers_wrappers_around_comm_are_left_out():
    """A check may wrap comm's calls (message_order): the student called comm.recv."""
    wrapped = rank_in(*COMM_RECV, frame(f"{PKG}/grading/message_order.py", 62, "recv"),
                      frame(CELL, 4, "pipelined"), frame(f"{PKG}/grading/lab01/jobs.py", 70, "broadcast_job"))
    state = diagnose_hang({0: wrapped, 1: wrapped}, 2, getline).ranks[0]
    assert (state.op, state.library) == ("recv", "course_lib.comm")
    assert "grading" not in state.stack and state.stack.splitlines()[2] == \
        '  File "course_lib/comm.py", line 119, in recv'


def test_same_collective_at_different_calls_and_other_kinds():
    first = rank_in(*TORCH_CALL["all_reduce"], frame(CELL, 6, "steps"))
    second = rank_in(*TORCH_CALL["all_reduce"], frame(CELL, 9, "steps"))
    diag = diagnose_hang({0: first, 1: second}, 2, getline)
    assert diag.kind == "same-collective"
    assert "They are at different calls: rank 0 at steps, line 6" in diag.hint
    busy = diagnose_hang({0: rank_in(frame(CELL, 30, "spin")), 1: first}, 2, getline)
    assert busy.kind == "missing-from-collective" and busy.ranks[0].status == "busy"
    assert "(rank 0 is still running your code, in no communication call)" in busy.hint
    spinning = diagnose_hang({r: rank_in(frame(CELL, 30, "spin")) for r in (0, 1)}, 2, getline)
    assert spinning.kind == "busy" and "endless loop" in spinning.hint
    importing = dump(WATCHER, thread([
        frame("<frozen importlib._bootstrap>", 1176, "_find_and_load"),
        frame(f"{TORCH}/__init__.py", 1531, "use_deterministic_algorithms"),
        frame(f"{PKG}/runtime/isolation.py", 74, "restore"), *SERVING[1:]], current=True))
    starting = diagnose_hang({0: importing, 1: importing}, 2, getline)
    assert starting.kind == "starting" and "timeout was too short" in starting.hint
    assert diagnose_hang({}, 2, getline).kind == "no-stacks"


def test_stack_reading_does_not_depend_on_where_things_are_installed():
    site = "/opt/conda/lib/python3.12/site-packages"
    elsewhere = "\n".join([
        "Stack (most recent call first):",  # a one-thread dump
        frame(f"{site}/torch/distributed/distributed_c10d.py", 2000, "all_reduce"),
        "  <no Python frame>",
        frame(f"{site}/torch/distributed/c10d_logger.py", 80, "wrapper"),
        frame("/home/student/course_lib/notebook_helpers.py", 3, "mine"),  # not the package
        frame("/srv/course/course_lib/runtime/worker.py", 138, "_run_call"),
        frame("/srv/course/course_lib/runtime/worker.py", 176, "_serve"),
        "  ..."])
    diag = diagnose_hang({0: elsewhere}, 1, getline)
    state = diag.ranks[0]
    assert (state.status, state.op, state.library, state.caller.func) == \
        ("blocked", "all_reduce", "torch.distributed", "mine")
    assert state.stack.splitlines()[0] == \
        '  File "/home/student/course_lib/notebook_helpers.py", line 3, in mine'
    assert "runtime/worker.py" not in state.stack


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


# launch after launch, ports counted (~30 s): `make test-slow`, which CI runs
@pytest.mark.slow
def test_launches_in_a_row_free_their_ports(monkeypatch):
    monkeypatch.setenv("COURSE_LIB_WARM", "0")  # every call a job of its own, ended after it
    ports = []
    for i in range(5):
        out = run(dist.get_rank, nproc=2, timeout=60)
        assert out == [0, 1], i
        assert port_is_free(out.port), f"launch {i}: port {out.port} still bound"
        ports.append(out.port)
    assert len(set(ports)) > 1  # a fresh port per launch


@pytest.mark.slow
def test_rendezvous_port_is_free_after_failure_and_timeout():
    run(int, nproc=2)  # start the job first: the short timeout is for the hang alone
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_keyboard_interrupt_kills_the_job_and_says_where_each_rank_was(interruptible, capsys):
    def both_receive():  # a deadlock: the usual reason a student stops a cell
        peer = torch.zeros(1)
        dist.recv(peer, src=1 - dist.get_rank())

    def interrupt_soon():
        time.sleep(6)
        os.kill(os.getpid(), signal.SIGINT)

    import threading

    threading.Thread(target=interrupt_soon, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run(both_receive, nproc=2, timeout=120)
    assert not stray_processes()
    err = capsys.readouterr().err
    assert "Interrupted: the job was stopped" in err, err
    # the diagnosis a timeout would give: each rank in its receive, the line quoted
    assert "dist.recv(peer, src=1 - dist.get_rank())" in err and "rank 1" in err, err


@pytest.mark.slow
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


def leaves_a_partial_line():
    """What C++ code in a rank (a profiler, glog) can do: write to the rank's stderr
    without a newline, just before the call returns."""
    os.write(2, b"[W a warning from C++, unfinished")
    return dist.get_rank()


def test_a_rank_leaving_a_partial_line_still_finishes_its_call():
    assert run(leaves_a_partial_line, nproc=2, timeout=30) == [0, 1]
    assert run(leaves_a_partial_line, nproc=2, timeout=30) == [0, 1]  # and the next one
