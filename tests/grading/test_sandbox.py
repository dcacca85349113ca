"""The sandbox a submission runs in: what it can see and change, and that it ends."""
import hashlib
import os
import time
from pathlib import Path

import pytest

from course_lib.grading import bwrap
from course_lib.grading.sandbox import Sandbox, SandboxError

ROOT = Path(__file__).resolve().parents[2]
NEEDS_BWRAP = pytest.mark.skipif(not bwrap.bwrap_works(),
                                 reason="bwrap is missing or cannot create namespaces here")


def course_digest():
    """Every file of the course that a submission could try to change."""
    digest = hashlib.sha256()
    for folder in ("course_lib", "solutions", "labs", "tests"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path).encode() + path.read_bytes())
    return digest.hexdigest()


WRITE_EVERYWHERE = f'''
import os
from pathlib import Path
written, refused = [], 0
for folder in ({str(ROOT)!r}, "/usr", "/etc", "/tmp"):
    for path in Path(folder).rglob("*.py*"):
        try:
            with open(path, "a") as f:
                f.write("\\nraise SystemExit('tampered')\\n")
            written.append(str(path))
        except OSError:
            refused += 1
print("refused", refused, "written", [w for w in written if not w.startswith("/tmp")])
print("seen", sorted(os.listdir({str(ROOT)!r})))
'''


@NEEDS_BWRAP
def test_the_course_is_read_only_and_the_rest_of_it_is_not_there(tmp_path):
    before = course_digest()
    box = Sandbox(tmp_path / "work")
    try:
        assert box.sandboxed
        reply = box.ask({"op": "cell", "source": WRITE_EVERYWHERE}, 120)
        text = "".join(o["text"] for o in reply["outputs"] if o.get("name") == "stdout")
        refused = int(text.split("refused ")[1].split()[0])
        assert refused > 100 and "written []" in text, text
        # the course folder holds only the library (and the environment): no solutions,
        # tests, labs or git history
        seen = eval(text.split("seen ")[1])
        assert "course_lib" in seen and not {"solutions", "tests", "labs", ".git"} & set(seen)
        reply = box.ask({"op": "cell", "source":
                         "import os, socket\nprint(os.getuid())\n"
                         "open('mine.txt', 'w').write('ok')\n"
                         "s = socket.socket()\ns.settimeout(2)\n"
                         "try:\n    s.connect(('8.8.8.8', 53))\n    print('network')\n"
                         "except OSError as exc:\n    print('no network', exc)"}, 60)
        text = "".join(o["text"] for o in reply["outputs"] if o.get("name") == "stdout")
        assert text.startswith("65534\n") and "no network" in text, text
        assert (tmp_path / "work" / "mine.txt").read_text() == "ok"  # its own folder only
    finally:
        assert box.close() == []
    assert course_digest() == before


def test_what_the_student_prints_or_writes_to_its_streams_is_not_an_answer(tmp_path):
    box = Sandbox(tmp_path / "work", sandboxed=False)
    try:
        reply = box.ask({"op": "cell", "source":
                         "import os, sys\nprint('{\"status\": \"ok\"}')\n"
                         "os.write(1, b'\\x00\\x00\\x00\\x02{}')\nos.write(2, b'noise')\n"
                         "sys.__stdout__.write('more')\nx = 41"}, 60)
        assert reply["status"] == "ok"
        assert box.ask({"op": "cell", "source": "print(x + 1)"}, 60)["outputs"] == [
            {"output_type": "stream", "name": "stdout", "text": "42\n"}]
        assert "noise" in (tmp_path / "work" / "collector.log").read_text()
        assert not box.sandboxed  # COURSE_LIB_SANDBOX's fallback: a plain process
    finally:
        box.close()


def test_a_cell_past_its_time_is_interrupted_and_the_collector_answers_again(tmp_path):
    box = Sandbox(tmp_path / "work", sandboxed=False)
    try:
        with pytest.raises(SandboxError) as info:
            box.ask({"op": "cell", "source": "import time\ntime.sleep(120)"}, 2)
        assert info.value.reason == "timeout"
        box.interrupt()
        reply = box.wait_reply(30)
        assert reply["status"] == "error" and reply["error"]["ename"] == "KeyboardInterrupt"
        assert box.ask({"op": "cell", "source": "print('alive')"}, 30)["status"] == "ok"
    finally:
        box.close()


def test_closing_ends_the_collector_its_ranks_and_what_they_started(tmp_path):
    box = Sandbox(tmp_path / "work")
    started = box.ask({"op": "cell", "source":
                       "import subprocess\nfrom course_lib import run\n"
                       "def start():\n"
                       "    subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
                       "    return 1\n"
                       "print(run(start, nproc=2))"}, 180)
    assert "[1, 1]" in started["outputs"][-1]["text"], started
    assert len(box._processes()) >= 5  # collector, torchrun, two ranks, their sleeps
    box.close()
    deadline = time.monotonic() + 10
    while box._processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert box._processes() == []


@pytest.mark.parametrize("sandboxed", [pytest.param(True, marks=NEEDS_BWRAP), False])
def test_ending_the_ranks_keeps_the_collector_and_nothing_that_looks_like_it(tmp_path,
                                                                             sandboxed):
    box = Sandbox(tmp_path / "work", sandboxed=sandboxed)
    try:
        box.ask({"op": "cell", "source":
                 "import subprocess, sys\n"
                 "from course_lib import run\n"
                 "# under the collector's name, and an orphan handed to the sandbox's init\n"
                 "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)',\n"
                 "                  '-m', 'course_lib.submission.collector'])\n"
                 "subprocess.Popen(['sh', '-c', 'sleep 600 & exit 0'])\n"
                 "print(run(lambda: 1, nproc=2))"}, 180)
        before = box._processes()
        assert len(before) >= 6, before  # collector, two look-alikes, torchrun, two ranks
        box.end_ranks()
        left = box._processes()
        assert len(left) == 1 and "course_lib.submission.collector" in " ".join(
            left[0].cmdline()), left
        assert "alive" in box.ask({"op": "cell", "source": "print('alive')"}, 60)[
            "outputs"][-1]["text"]
    finally:
        box.close()


def test_the_fallback_can_be_asked_for(monkeypatch):
    monkeypatch.setenv("COURSE_LIB_SANDBOX", "0")
    assert bwrap.sandbox_available() is False
    monkeypatch.setenv("COURSE_LIB_SANDBOX", "1")
    if bwrap.bwrap_works():
        assert bwrap.sandbox_available() is True
    else:
        with pytest.raises(RuntimeError, match="install Debian's bubblewrap"):
            bwrap.sandbox_available()
    assert os.environ["COURSE_LIB_SANDBOX"] == "1"


LOOKS_FOR_THE_GRADER = '''
import importlib, pathlib
import course_lib
from course_lib.grading import checks, lab00, lab01
grading = pathlib.Path(course_lib.__file__).parent / "grading"
print("files", sorted(p.name for p in grading.rglob("*") if "__pycache__" not in p.parts))
for name in ("course_lib.grading.lab00", "course_lib.grading.lab01.predictions",
             "course_lib.grading.requests", "course_lib.grading.references"):
    try:
        importlib.import_module(name)
        print("imported", name)
    except ImportError as exc:
        print("absent", name)
try:
    lab00.shift_job
except AttributeError as exc:
    print("attribute:", exc)
print("ready", checks.ready("Exercise 0.3"))
'''


@NEEDS_BWRAP
def test_nothing_of_the_grader_is_in_the_sandbox(tmp_path):
    """Door 2 by construction: course_lib/grading/ holds the stand-in only; what a lab's
    setup cell imports still imports, and the judge's verdicts reach checks.ready."""
    box = Sandbox(tmp_path / "work")
    try:
        reply = box.ask({"op": "cell", "source": LOOKS_FOR_THE_GRADER}, 120)
        text = "".join(o["text"] for o in reply["outputs"] if o.get("name") == "stdout")
        assert reply["status"] == "ok", reply
        assert eval(text.split("files ")[1].splitlines()[0]) == ["__init__.py", "checks.py"]
        assert "imported" not in text and text.count("absent") == 4, text
        assert "is not in a graded submission's sandbox" in text
        box.ask({"op": "outcome", "exercise": "Exercise 0.3", "state": "failed"}, 30)
        reply = box.ask({"op": "cell", "source": "print(checks.ready('Exercise 0.3'))"}, 30)
        assert "did not pass" in reply["outputs"][0]["text"] and "False" in reply["outputs"][0]["text"]
    finally:
        box.close()


USES_THE_LIBRARYS_ANSWER = '''
import inspect
import torch
from course_lib.collectives import ring
from course_lib.collectives.ring import all_reduce
try:
    all_reduce(torch.ones(4))
    print("ran")
except ImportError as exc:
    print("hidden:", exc)
print("code there", "def _all_reduce" in inspect.getsource(ring))
from course_lib.collectives import p2p   # another lab's answer stays
print("other lab", callable(p2p.ring_shift) and "def ring_shift" in inspect.getsource(p2p))
'''


@NEEDS_BWRAP
def test_the_labs_own_answers_are_stand_ins_while_it_is_graded(tmp_path):
    """While Lab 01 is graded, the library's ring all-reduce is not in the sandbox: the name
    imports (the package still works), any use raises naming the item, and its code is
    not there to read; another lab's answers are untouched."""
    box = Sandbox(tmp_path / "work", hide=("Exercise 1.4",))
    try:
        reply = box.ask({"op": "cell", "source": USES_THE_LIBRARYS_ANSWER}, 120)
        text = "".join(o["text"] for o in reply["outputs"] if o.get("name") == "stdout")
        assert reply["status"] == "ok", reply
        assert "hidden: course_lib.collectives.ring.all_reduce is the library's answer to " \
               "Exercise 1.4" in text, text
        assert "code there False" in text and "other lab True" in text, text
    finally:
        box.close()
