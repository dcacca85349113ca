"""What torchrun starts on every rank: ``python -m course_lib.runtime.worker JOB_DIR``.

Prefixes every line this rank prints with ``[rankR]``, arms faulthandler so the
notebook can ask for this rank's stack, watches the notebook kernel's pid, and
then either runs a script (``mode: script``, a fresh job per script) or
*serves*: joins the process group once and runs the calls the notebook sends,
one after another, until told to stop (warm ranks).

Serving, call by call:

1. wait for ``task/N`` in the notebook's key-value store (a TCPStore the
   notebook hosts; its port is in ``COURSE_LIB_STORE_PORT``);
2. put the rank back into the state it had before the first call
   (:class:`~course_lib.runtime.isolation.Baseline`), start a trace;
3. run the pickled function or cell from ``taskN.pkl``;
4. write ``result{rank}-{N}.pkl`` (value moved to CPU, plus the trace), destroy
   the process groups the call created, and print a marker line that tells
   the notebook this rank is done with call N.

A rank whose call raises writes ``error{rank}.json`` with the traceback and
exits: torchrun ends the other ranks (one may be stuck in a collective that
will never complete), and the notebook starts a fresh job next time.

``mode: once`` (a call with ``max_restarts``): no serving; the rank joins the group,
runs the one function, writes ``result{rank}-1.pkl`` and exits. When a rank fails,
torchrun ends them all and starts every rank afresh, with
``TORCHELASTIC_RESTART_COUNT`` one higher, until the function returns on every rank
of one attempt or the restarts run out; each record says which attempt wrote it.
"""
from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

from course_lib.runtime.output import marker
from course_lib.runtime import rank_io
from course_lib.runtime.rank_io import (RankPrefixed, remove_orphaned_folder, to_cpu,
                                        watch_launcher, write_whole)


def _user_traceback(exc):
    """The traceback without the rank's own frames (this module's, rank_io's) before the
    student's."""
    tb, ours = exc.__traceback__, {__file__, rank_io.__file__}
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _mark_when_ended(job, rank):
    """Arm ``ended{rank}.txt``: torchrun ends the other ranks with SIGTERM once one has
    failed, and this rank then writes its stack there from inside the signal handler (C,
    so even in a blocking collective) before dying as SIGTERM would have it. A rank that
    is gone with no record, no result and an empty mark died of something else (SIGKILL,
    the out-of-memory killer, a crash in C code): that is the failure the job names."""
    for stale in (job / f"ended{rank}.txt", job / f"result{rank}-1.pkl"):  # an earlier attempt's
        stale.unlink(missing_ok=True)
    mark = open(job / f"ended{rank}.txt", "w")
    faulthandler.register(signal.SIGTERM, file=mark, all_threads=False, chain=True)


def _run_script(job):
    script = json.loads((job / "payload.json").read_text())
    sys.argv = [script["path"], *script["argv"]]
    sys.path.insert(0, str(Path(script["path"]).parent))
    runpy.run_path(script["path"], run_name="__main__")


def _run_call(job, task, rank):
    """One call of a serving rank; returns (value on CPU, trace export)."""
    import cloudpickle
    import torch.distributed as dist

    from course_lib import trace
    from course_lib.runtime import nccl_rules
    from course_lib.runtime.backend import current_device

    obj = cloudpickle.loads((job / f"task{task['id']}.pkl").read_bytes())
    trace.start()
    if nccl_rules.active():  # the call's own collectives count from 1 (after trace's barrier)
        nccl_rules.begin_call(task["id"])
    if task["mode"] == "fn":
        fn, args, kwargs = obj
        result = fn(*args, **kwargs)
    else:
        source, namespace = obj
        namespace.update(__name__="__main__", rank=rank, world_size=dist.get_world_size(),
                         local_rank=int(os.environ["LOCAL_RANK"]), device=current_device())
        exec(compile(source, "<%%torchrun cell>", "exec"), namespace)
        result = None
    return to_cpu(result), trace.finish()


def attempt():
    """How many times torchrun has restarted this job's ranks (0 on the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _run_once(job, spec, rank):
    """One function, one attempt: join the group, run it, write the result, leave."""
    import cloudpickle
    import torch
    import torch.distributed as dist

    from course_lib.runtime.backend import current_device, init_distributed

    backend = init_distributed(spec["backend"], timeout_s=spec["timeout"] + 60)
    if backend == "nccl":
        torch.set_default_device(current_device())
    # call 1, as a warm rank's first: the trace's opening barrier is NCCL-rule call 0
    try:
        value, exported = _run_call(job, {"id": 1, "mode": "fn"}, rank)
    except SystemExit as exc:  # a quiet exit would leave its peers waiting in the barrier
        raise RuntimeError(f"the function ended its process with sys.exit({exc.code!r}) "
                           f"instead of returning") from None
    write_whole(job / f"result{rank}-1.pkl", cloudpickle.dumps((value, exported)))
    if dist.is_initialized():  # (the function may have ended the group itself)
        # rank 0 hosts this attempt's store (command.py): nobody leaves while a peer may
        # still need it
        dist.barrier()
        dist.destroy_process_group()


def _check_destroy_order(store, number, rank):
    """NCCL's rule 5 (:mod:`course_lib.runtime.nccl_rules`): the ranks destroyed the
    groups they share in one order, in this call and the clean-up after it."""
    import torch.distributed as dist

    from course_lib.runtime import nccl_rules

    store.set(f"rules/destroyed/{number}/{rank}", json.dumps(nccl_rules.destroyed))
    nccl_rules.destroyed.clear()
    orders = {r: json.loads(store.get(f"rules/destroyed/{number}/{r}"))
              for r in range(dist.get_world_size())}
    nccl_rules.check_destroy_order(orders)


def _serve(job, spec, rank):
    import cloudpickle
    import torch
    import torch.distributed as dist

    from course_lib.runtime.backend import current_device, init_distributed
    from course_lib.runtime.isolation import Baseline

    backend = init_distributed(spec["backend"], timeout_s=spec["timeout"] + 60)
    device = current_device()
    if backend == "nccl":
        # notebook code says torch.zeros(...): on a GPU rank that should mean its GPU
        torch.set_default_device(device)
    # The notebook's store; a rank waiting longer than the idle limit (plus a
    # margin for the notebook's own timer) gives up and ends the job.
    store = dist.TCPStore("127.0.0.1", int(os.environ["COURSE_LIB_STORE_PORT"]), is_master=False,
                          timeout=timedelta(seconds=spec["idle_s"] + 120))
    baseline = Baseline(default_device=device if backend == "nccl" else None)
    number = 0
    while True:
        number += 1
        try:
            task = json.loads(store.get(f"task/{number}"))
        except dist.DistStoreError:
            return  # idle for too long: nobody will send more work
        if task.get("stop"):
            return
        baseline.restore(cwd=task["cwd"])
        value, exported = _run_call(job, task, rank)
        (job / f"result{rank}-{number}.pkl").write_bytes(cloudpickle.dumps((value, exported)))
        reusable = baseline.release_groups()
        if spec.get("nccl_rules"):
            _check_destroy_order(store, number, rank)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.__stdout__.write(marker("done" if reusable else "retire", number, rank))
        sys.__stdout__.flush()
        if not reusable:
            return


def main(job_dir=None):
    """A rank's life: ``job_dir`` from the command line (torchrun starts this module) or
    as the argument (:mod:`course_lib.runtime.agent` forks this function)."""
    forked = job_dir is not None
    job = Path(job_dir if forked else sys.argv[1])
    if forked:  # a fresh interpreter's signal handling, not the agent's (whose SIGTERM
        # handler would wait for this rank's blocking call to return before it could act)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    spec = json.loads((job / "spec.json").read_text())
    rank = int(os.environ["RANK"])
    sys.stdout = RankPrefixed(sys.__stdout__, f"[rank{rank}] ")
    sys.stderr = RankPrefixed(sys.__stderr__, f"[rank{rank}] ")
    # append mode: the notebook truncates the file before asking for a fresh dump
    stack_file = open(job / f"stack{rank}.txt", "a")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    _mark_when_ended(job, rank)
    (job / f"pid{rank}").write_text(str(os.getpid()))
    threading.Thread(target=watch_launcher, args=(spec["launcher_pid"], job, rank, forked),
                     daemon=True).start()
    if rank == 0:  # the port torchrun's rendezvous store bound (it chose it: port 0)
        (job / "port").write_text(os.environ.get("MASTER_PORT", ""))
        write_whole(job / "restarts", str(attempt()).encode())
    code = 0
    try:
        if spec.get("nccl_rules"):
            from course_lib.runtime import nccl_rules

            nccl_rules.install()
        if spec["mode"] == "script":
            _run_script(job)
        elif spec["mode"] == "once":
            _run_once(job, spec, rank)
        else:
            _serve(job, spec, rank)
    except SystemExit as exc:
        if exc.code not in (0, None):
            code = _report(job, rank, exc)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the notebook
        code = _report(job, rank, exc)
    finally:  # (reporting to a kernel that has died raises BrokenPipeError)
        if not forked:
            remove_orphaned_folder(job, rank)
    try:  # an exit of its own: not a silent death (Job._ended_silently)
        with open(job / f"ended{rank}.txt", "a") as mark:
            mark.write(f"exited with status {code}\n")
    except OSError:  # the job's folder is gone with its kernel
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    if forked and code == 0:
        return 0  # the agent's process wrapper hands this back and ends us with os._exit
    # Skip interpreter teardown: a failed rank's peers may still hold sockets open,
    # and gloo's threads can block a normal exit.
    os._exit(code)


def _report(job, rank, exc):
    # the clock first: the job names the rank that failed first as the cause, and
    # formatting a long traceback must not make the first failure look like a later one
    failed_at = time.time()
    record = {"rank": rank, "type": type(exc).__name__, "message": str(exc),
              "traceback": _user_traceback(exc), "time": failed_at, "attempt": attempt()}
    write_whole(job / f"error{rank}.json", json.dumps(record).encode())
    # The full traceback travels in the LaunchError; one line here keeps the
    # cell readable when the other ranks fail as a consequence.
    print(f"failed with {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
