"""The student's side of grading: one submission's cells and requests, in a sandbox.

``python -m course_lib.submission.collector`` is what the gradebook's judge starts
inside the sandbox (:mod:`course_lib.grading.sandbox`), where ``course_lib.grading``
is not there: in its place the sandbox holds :mod:`course_lib.submission.grading`, a
stand-in with nothing of the grader. This small fixed program runs the submission's
code cells in an IPython shell, one at a time as the judge sends them, and answers
the judge's requests (:mod:`course_lib.submission.calls`) by running the harness the
judge sent *by value* with the student's objects, on real ranks or here. It holds no
expected value and compares nothing: what it sends back is plain data, and the
judge, which never runs student code, decides. What it runs a request with (``bind``
and ``execute``) it takes before any student code runs, so a cell that replaces them
by name changes nothing.

The protocol runs over this process's original stdin and stdout, moved to
private descriptors at start-up; what the student's code prints (on fd 1 and 2)
goes to a log file instead, so it cannot be mistaken for an answer. Each message
is a 4-byte length and a body: the judge's are pickles (the judge is trusted),
this process's are JSON (read by the judge as data only).

    judge -> {"op": "cell", "source": ...}                       -> {"status", "error", "outputs"}
    judge -> {"op": "request", "exercise": ..., "request": Request} -> an outcome
    judge -> {"op": "outcome", "exercise": ..., "state": "passed"|"failed"}
    judge -> {"op": "define", "name": ..., "value": ...}   (tests: a student's object, pickled)
    judge -> {"op": "bye"}
"""
from __future__ import annotations

import json
import os
import pickle
import resource
import signal
import struct
import sys

MAX_OUTPUT = 200_000  # characters of a cell's text output kept for the executed notebook
HEADER = struct.Struct(">I")


def read_message(fd):
    """One framed message from ``fd`` (bytes), or None at end of input."""
    header = _read_exactly(fd, HEADER.size)
    if header is None:
        return None
    body = _read_exactly(fd, HEADER.unpack(header)[0])
    if body is None:
        raise EOFError("the stream ended inside a message")
    return body


def _read_exactly(fd, size):
    """``size`` bytes, or None if the stream ends first."""
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_message(fd, body):
    data = HEADER.pack(len(body)) + body
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _limit_resources():
    """Bounds for this process and everything it starts (ranks included): address
    space, file size, no core dumps. The judge bounds time."""
    memory = int(float(os.environ.get("COURSE_LIB_SANDBOX_MEMORY_GB", "16")) * 2**30)
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, 2**30),
                         (resource.RLIMIT_CORE, 0)):
        soft, hard = resource.getrlimit(limit)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))


class Collector:
    def __init__(self, full, bind, execute):
        self._bind, self._execute = bind, execute
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        class Shell(InteractiveShell):
            def enable_gui(self, gui=None):  # no event loop here: figures are inline PNGs
                pass

        config = Config()
        config.HistoryManager.enabled = False
        config.InteractiveShell.colors = "nocolor"
        self.shell = Shell.instance(config=config)
        if full:  # figures as PNG outputs, as a kernel would show them
            self.shell.enable_matplotlib("inline")

    def cell(self, source):
        from IPython.utils.capture import capture_output

        with capture_output(stdout=True, stderr=True, display=True) as captured:
            result = self.shell.run_cell(source, store_history=True)
        outputs = []
        for name in ("stdout", "stderr"):
            text = getattr(captured, name)
            if text:
                outputs.append({"output_type": "stream", "name": name,
                                "text": _clip(text)})
        for shown in captured.outputs:
            data = {k: v if isinstance(v, str) else json.dumps(v)
                    for k, v in (shown.data or {}).items() if isinstance(k, str)}
            outputs.append({"output_type": "display_data", "data": data, "metadata": {}})
        error = result.error_in_exec or result.error_before_exec
        reply = {"status": "ok" if error is None else "error", "outputs": outputs}
        if error is not None:
            reply["error"] = {"ename": type(error).__name__, "evalue": _clip(str(error), 2000)}
        return reply

    def request(self, request):
        try:
            bound = self._bind(request, self.shell.user_ns)
        except NameError as exc:
            return {"missing": str(exc)}
        return self._execute(bound)

    def outcome(self, exercise, state):
        """Tell the notebook's ``checks.ready`` how the judge decided (a demo cell may
        skip code whose check failed)."""
        import importlib

        importlib.import_module("course_lib.grading.checks")._record(exercise, state)
        return {"ok": True}


def _clip(text, limit=MAX_OUTPUT):
    return text if len(text) <= limit else text[:limit] + f"\n... ({len(text) - limit} more characters)"


def main():
    # the protocol keeps the original stdin/stdout; fds 0-2 become the student's
    requests_fd, replies_fd = os.dup(0), os.dup(1)
    log = os.open(os.environ.get("COURSE_LIB_COLLECTOR_LOG", "collector.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    _limit_resources()
    # the judge stops a cell that outlives its time with SIGINT; a process started from a
    # background job (make in CI, nohup) inherits SIGINT ignored, so say what it does here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from course_lib.submission.calls import bind, execute

    collector = Collector(os.environ.get("COURSE_LIB_COLLECTOR_FULL") == "1", bind, execute)
    write_message(replies_fd, json.dumps({"ready": True}).encode())
    while True:
        body = read_message(requests_fd)
        if body is None:
            break
        message = pickle.loads(body)
        op = message.get("op")
        if op == "bye":
            break
        try:
            if op == "cell":
                reply = collector.cell(message["source"])
            elif op == "request":
                reply = collector.request(message["request"])
            elif op == "outcome":
                reply = collector.outcome(message["exercise"], message["state"])
            elif op == "define":
                collector.shell.user_ns[message["name"]] = message["value"]
                reply = {"ok": True}
            else:
                reply = {"unknown": str(op)}
        except KeyboardInterrupt:
            reply = {"interrupted": True}
        write_message(replies_fd, json.dumps(reply, default=str).encode())
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        from course_lib.runtime import warm

        warm.shutdown()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
