"""Shared fixtures: every launcher test must leave no process of any job behind."""
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import cloudpickle
import psutil
import pytest

from course_lib.runtime import procs

# Jobs started by this test session (directly, or from a notebook kernel it runs)
# inherit this variable; another session running on the same machine does not.
SESSION_VAR = "COURSE_LIB_TEST_SESSION"
os.environ[SESSION_VAR] = uuid.uuid4().hex
# A temp folder of the session's own (jobs, kernels and their children inherit it): job
# folders left behind are this session's, whatever else runs on the machine.
SESSION_TMP = Path(tempfile.mkdtemp(prefix="course-tests-"))
os.environ["TMPDIR"] = str(SESSION_TMP)
tempfile.tempdir = None
# `make test` sets COURSE_LIB_GPU_LOOKALIKE=1: every job, notebook kernel and rank this
# session starts then sees one GPU (tests/gpu_lookalike), as on a student's one-GPU
# machine, while real CUDA work raises there; a rank that reaches for the GPU beside
# its gloo backend fails the test. This process keeps its own view (no GPU).
LOOKALIKE = Path(__file__).resolve().parent / "gpu_lookalike"


def path_with_lookalike():
    """PYTHONPATH with tests/gpu_lookalike first (its sitecustomize runs in every process
    started with it; COURSE_LIB_GPU_LOOKALIKE says what it does)."""
    return os.pathsep.join(p for p in (str(LOOKALIKE), os.environ.get("PYTHONPATH")) if p)


if os.environ.get("COURSE_LIB_GPU_LOOKALIKE") == "1":
    os.environ["PYTHONPATH"] = path_with_lookalike()
# Tests run at world sizes 1 to 8, module after module: keep more warm jobs than a kernel
# needs (4), so that fewer calls pay for a cold start (tests of the limit set their own)
os.environ.setdefault("COURSE_LIB_WARM_MAX", "6")
# The gradebook's hidden settings come from the class's secret: a fixed one here, so that
# every run of the suite grades the same drawn settings (make salt-sweep draws others)
os.environ.setdefault("COURSE_LIB_GRADING_SECRET", "the course's own tests")


def job_processes():
    """Every live process of a course_lib job started by this test session,
    read from the process table."""
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if procs.MARKER in env and env.get(SESSION_VAR) == os.environ[SESSION_VAR]:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def stray_processes():
    """Job processes other than this test process's warm jobs and the shared sandbox's
    (which may stay up between tests: that is what they are for)."""
    from course_lib.grading.sandbox import RUN_MARKER
    from course_lib.runtime import warm

    keep = warm.current_job_ids()
    strays = []
    for p in job_processes():
        try:
            env = p.environ()
            if env.get(procs.MARKER) not in keep and env.get(RUN_MARKER) not in SANDBOXES:
                strays.append(p)
        except (psutil.Error, OSError):
            continue
    return strays


def settled(find, limit_s):
    """``find()`` again until it comes back empty or ``limit_s`` has passed: the
    jobs of a notebook kernel that was just killed take a moment to follow it
    (their ranks watch its pid)."""
    deadline = time.monotonic() + limit_s
    left = find()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = find()
    return left


JOB_FOLDERS = set()  # reported already


def stray_folders():
    """Job folders (``course-job-*`` in the temp folder) that no live job of this test
    process owns: a job's folder goes when its job ends, whatever ended it."""
    from course_lib.runtime import warm

    live = {job.dir for job in warm.jobs()}
    return sorted(set(Path(tempfile.gettempdir()).glob("course-job-*")) - JOB_FOLDERS - live)


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    left = settled(stray_processes, 10)
    assert not left, f"processes left running after the test: {[(p.pid, p.cmdline()) for p in left]}"
    folders = settled(stray_folders, 10)
    JOB_FOLDERS.update(folders)  # reported once
    assert not folders, f"job folders left behind by the test: {folders}"


@pytest.fixture(scope="session", autouse=True)
def nothing_left_at_the_end():
    yield
    from course_lib import shutdown

    shutdown()
    left = settled(job_processes, 20)
    assert not left, f"processes left after shutdown(): {[(p.pid, p.cmdline()) for p in left]}"
    # A notebook kernel killed outright (nbval's teardown) leaves its torchrun job's folder
    # to the job's rank 0, or, when the rank ended first, to the next launch's sweep: run it
    # here as that launch would, again while the killed kernel's ranks are still ending
    # (a sweep skips a folder a live rank works in). What it cannot remove is a leak.
    from course_lib.runtime import folders as job_folders

    def unswept():
        job_folders.sweep_folders()
        return stray_folders()

    folders = settled(unswept, 20)
    assert not folders, f"job folders left after shutdown(): {folders}"
    shutil.rmtree(SESSION_TMP, ignore_errors=True)


SANDBOXES = set()  # tokens of the session's shared sandboxes


@pytest.fixture
def interruptible():
    """SIGINT raises KeyboardInterrupt here, as in a notebook kernel, also where this
    test process inherited it ignored (a make started from a background job)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory):
    """One collector in its sandbox for the whole session, as the gradebook starts one per
    notebook: tests ship the student's objects into it and judge them as the gradebook does."""
    from course_lib.grading.sandbox import Sandbox

    box = Sandbox(tmp_path_factory.mktemp("sandbox"))
    SANDBOXES.add(box.token)
    yield box
    killed = box.close()
    SANDBOXES.discard(box.token)
    assert not killed, f"the sandbox's processes had to be killed: {killed}"


def judged(box, check, *student, seed=None, **options):
    """``check(*student, **options)`` decided as the gradebook's judge decides it: the
    student's objects (shipped by value) live in the sandbox ``box``, the requests run
    there, and the comparison happens here; with ``seed``, on the hidden settings it
    draws too. Returns the pass line or raises as the check does (CheckFailed,
    NotImplementedError)."""
    from course_lib.grading.judge import judge_check

    names = []
    for index, obj in enumerate(student):
        names.append(f"_student_{index}")
        box.ask({"op": "define", "name": names[-1], "value": obj}, 60)
    return judge_check(check, names, options, box.ask, seed=seed)


def ship_by_value(module_name):
    """Test modules are not importable on the ranks; ship their functions by
    value, as a notebook's are."""
    cloudpickle.register_pickle_by_value(sys.modules[module_name])


def needs_gpus(count):
    """Skip a module's tests, saying why, unless ``count`` CUDA GPUs and NCCL are there."""
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count()
    return pytest.mark.skipif(
        gpus < count or not dist.is_nccl_available(),
        reason=f"needs {'a CUDA GPU' if count == 1 else f'{count} CUDA GPUs'} and NCCL "
               f"(torch sees {gpus} GPU(s), NCCL "
               f"{'available' if dist.is_nccl_available() else 'missing'})")


def run_bench(tmp_path, what, *args, timeout=300):
    """``python -m course_lib.bench <what> <args> --json <file>`` as a user runs it:
    (the finished process, the JSON it wrote or None when it failed)."""
    import json
    import subprocess

    out = tmp_path / f"{what}.json"
    proc = subprocess.run([sys.executable, "-m", "course_lib.bench", what, *map(str, args),
                           "--json", str(out)], capture_output=True, text=True, timeout=timeout)
    return proc, (json.loads(out.read_text()) if proc.returncode == 0 else None)
