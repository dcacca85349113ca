"""A job's output, read as it arrives: the ranks' lines, torchrun's lines, and markers.

Every rank prefixes its lines with ``[rankR]`` (:mod:`course_lib.runtime.rank_io`);
those are printed into the cell at once. A line without the prefix is torchrun's
own (its warnings, its failure summary): kept in ``log``, shown only when something
fails. A marker line is how a rank tells the notebook where it is (done with call N,
or done and serving no more); it is one write of its own and is never printed.
"""
from __future__ import annotations

import queue
import re
import threading
import time

RANK_LINE = re.compile(r"^\[rank(\d+)\]")
# kind, task, rank. Found anywhere in a line: C++ code in a rank (a profiler, glog) writes
# to the same pipe without Python's buffering, and a partial line of its own can come
# first; the marker itself is one write, so nothing lands inside it.
MARKER_LINE = re.compile(r"\x1fcourse_lib (\w+) (\d+) (\d+)$")
# After torchrun exits, lines still in the pipe are read for at most this long
# (a grandchild a rank left behind may hold the pipe open for ever).
DRAIN_S = 0.5


def marker(kind, task, rank):
    """The line a rank writes (raw, unprefixed) to tell the notebook where it is."""
    return f"\x1fcourse_lib {kind} {task} {rank}\n"


class Output:
    """The merged stdout and stderr of ``proc`` (torchrun), read on a thread of its own
    for the process's whole life, so that a call can stop reading at a marker, at the
    process's exit or at a deadline, whichever comes first."""

    def __init__(self, proc, name):
        self.proc = proc
        self.log = []  # torchrun's own lines (not a rank's): shown when something fails
        self._lines = queue.Queue()
        threading.Thread(target=self._read, name=name, daemon=True).start()

    def _read(self):
        try:
            for line in self.proc.stdout:
                self._lines.put(line)
        except (OSError, ValueError):  # the pipe was closed under us by the job's end
            pass
        self._lines.put(None)

    def pump(self, deadline, on_marker=None):
        """Print rank lines as they arrive, keep torchrun's in ``log``, hand marker
        lines to ``on_marker(kind, task, rank)`` (which returns True when the call is
        complete). Returns "done", "exited" or "timeout"."""
        exited_at = None
        while True:
            now = time.perf_counter()
            if exited_at is None and self.proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > DRAIN_S:
                return "exited"
            if now > deadline:
                return "timeout"
            try:
                line = self._lines.get(timeout=0.02)
            except queue.Empty:
                continue
            if line is None:  # end of output: the process has exited or is about to
                self.proc.wait()
                return "exited"
            found = MARKER_LINE.search(line.rstrip("\n"))
            if found:
                if found.start():  # what another writer had begun on the same line
                    self.log.append(line[:found.start()] + "\n")
                kind, task, rank = found.group(1), int(found.group(2)), int(found.group(3))
                if on_marker is not None and on_marker(kind, task, rank):
                    return "done"
            elif RANK_LINE.match(line):
                print(line, end="", flush=True)
            else:
                self.log.append(line)
