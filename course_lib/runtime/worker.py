"""What torchrun starts on every rank: ``python -m course_lib.runtime.worker JOB_DIR``.

Reads the job the launcher wrote (a pickled function, a cell, or a script path),
prefixes every line this rank prints with ``[rankR]``, arms faulthandler so the
launcher can ask for this rank's stack, runs the job, and writes back either the
result (plus this rank's trace) or an error record with the traceback.
"""
from __future__ import annotations

import faulthandler
import io
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from pathlib import Path


class _RankPrefixed(io.TextIOBase):
    """A text stream that writes whole lines, each prefixed, in one write call
    (writes up to PIPE_BUF are atomic, so ranks' lines do not interleave)."""

    def __init__(self, stream, prefix):
        self._stream, self._prefix, self._partial = stream, prefix, ""
        self._lock = threading.Lock()

    def writable(self):
        return True

    def write(self, text):
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
            if lines:
                self._stream.write("".join(f"{self._prefix}{ln}\n" for ln in lines))
                self._stream.flush()
        return len(text)

    def flush(self):
        with self._lock:
            if self._partial:
                self._stream.write(f"{self._prefix}{self._partial}\n")
                self._partial = ""
            self._stream.flush()


def _watch_launcher(pid):
    """End this rank if the notebook kernel that launched it has gone."""
    while True:
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:
            pass


def _to_cpu(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _user_traceback(exc):
    """The traceback without the launcher's own frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _run_job(job, spec, rank):
    import cloudpickle
    import torch

    from course_lib import trace
    from course_lib.runtime.backend import current_device, init_distributed

    payload = (job / "payload.pkl").read_bytes()
    if spec["mode"] == "script":
        script = json.loads(payload)
        sys.argv = [script["path"], *script["argv"]]
        sys.path.insert(0, str(Path(script["path"]).parent))
        runpy.run_path(script["path"], run_name="__main__")
        return None, None
    obj = cloudpickle.loads(payload)
    backend = init_distributed(spec["backend"], timeout_s=spec["timeout"] + 60)
    if backend == "nccl":
        # notebook code says torch.zeros(...): on a GPU rank that should mean its GPU
        torch.set_default_device(current_device())
    trace.start()
    import torch.distributed as dist

    if spec["mode"] == "fn":
        fn, args, kwargs = obj
        result = fn(*args, **kwargs)
    else:
        source, namespace = obj
        namespace.update(__name__="__main__", rank=dist.get_rank(),
                         world_size=dist.get_world_size(),
                         local_rank=int(os.environ["LOCAL_RANK"]), device=current_device())
        exec(compile(source, "<%%torchrun cell>", "exec"), namespace)
        result = None
    exported = trace.finish()
    dist.destroy_process_group()
    return _to_cpu(result), exported


def main():
    job = Path(sys.argv[1])
    spec = json.loads((job / "spec.json").read_text())
    rank = int(os.environ["RANK"])
    sys.stdout = _RankPrefixed(sys.__stdout__, f"[rank{rank}] ")
    sys.stderr = _RankPrefixed(sys.__stderr__, f"[rank{rank}] ")
    stack_file = open(job / f"stack{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    (job / f"pid{rank}").write_text(str(os.getpid()))
    threading.Thread(target=_watch_launcher, args=(spec["launcher_pid"],), daemon=True).start()
    try:
        import cloudpickle

        result = _run_job(job, spec, rank)
        (job / f"result{rank}.pkl").write_bytes(cloudpickle.dumps(result))
        code = 0
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the notebook
        if isinstance(exc, SystemExit) and exc.code in (0, None) and spec["mode"] == "script":
            (job / f"result{rank}.pkl").write_bytes(__import__("pickle").dumps((None, None)))
            code = 0
        else:
            tb = _user_traceback(exc)
            record = {"rank": rank, "type": type(exc).__name__, "message": str(exc),
                      "traceback": tb, "time": time.time()}
            (job / f"error{rank}.json").write_text(json.dumps(record))
            # The full traceback travels in the LaunchError; one line here keeps the
            # cell readable when the other ranks fail as a consequence.
            print(f"failed with {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a failed rank's peers may still hold sockets open,
    # and gloo's threads can block a normal exit.
    os._exit(code)


if __name__ == "__main__":
    main()
