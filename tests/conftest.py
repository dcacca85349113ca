"""Shared fixtures: every launcher test must leave no process of any job behind."""
import sys

import cloudpickle
import psutil
import pytest

from course_lib import _procs


def job_processes():
    """Every live process carrying a course_lib job marker (from the process table)."""
    found = []
    for p in psutil.process_iter():
        try:
            if _procs.MARKER in p.environ():
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
