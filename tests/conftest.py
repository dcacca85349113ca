"""Shared fixtures: every launcher test must leave no process of any job behind."""
import os
import sys
import uuid

import cloudpickle
import psutil
import pytest

from course_lib.runtime import procs

# Jobs started by this test session (directly, or from a notebook kernel it runs)
# inherit this variable; another session running on the same machine does not.
SESSION_VAR = "COURSE_LIB_TEST_SESSION"
os.environ[SESSION_VAR] = uuid.uuid4().hex


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


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    left = job_processes()
    assert not left, f"processes left running after the test: {[(p.pid, p.cmdline()) for p in left]}"


def ship_by_value(module_name):
    """Test modules are not importable on the ranks; ship their functions by
    value, as a notebook's are."""
    cloudpickle.register_pickle_by_value(sys.modules[module_name])
