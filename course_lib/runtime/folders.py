"""A job's folder: removed when its job ends, and swept when a killed kernel left it.

The folder holds what a job's ranks and the notebook pass each other (payloads,
results, records, stack dumps) and torchrun's temporary files; its ``spec.json``
names the kernel that started it, so a folder whose kernel has gone can be told
from one in use.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import psutil


def launcher_alive(job_dir):
    """Whether the process that started the job in ``job_dir`` (its ``spec.json`` says
    which) is still running; True when that cannot be read (never remove on a doubt)."""
    try:
        pid = json.loads((Path(job_dir) / "spec.json").read_text())["launcher_pid"]
    except (OSError, ValueError, KeyError):
        return True
    try:  # a kernel that has died but not yet been reaped has gone all the same
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # not ours to read: alive while its pid is
        return psutil.pid_exists(pid)


def rank_pids(job_dir):
    """The pids the ranks wrote at start (``pid<rank>``), whether they are alive or not."""
    pids = []
    for path in sorted(Path(job_dir).glob("pid*")):
        try:
            pids.append(int(path.read_text()))
        except (OSError, ValueError):
            continue
    return pids


def remove_folder(job_dir):
    """Remove a job's folder, its ``spec.json`` last: a removal cut short (a kernel
    killed in the middle of it) still says whose folder it was, for :func:`sweep_folders`."""
    job_dir = Path(job_dir)
    for entry in list(job_dir.iterdir()) if job_dir.is_dir() else []:
        if entry.name != "spec.json":
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    shutil.rmtree(job_dir, ignore_errors=True)


def sweep_folders(root=None):
    """Remove job folders (``course-job-*``) whose launcher has gone and that no
    process works in: what a kernel killed in the middle of its clean-up left."""
    root = Path(root or tempfile.gettempdir())
    busy = set()
    for proc in psutil.process_iter():
        try:
            busy.add(proc.environ().get("TMPDIR"))
        except (psutil.Error, OSError):
            continue
    for folder in root.glob("course-job-*"):
        if str(folder) not in busy and (folder / "spec.json").exists() \
                and not launcher_alive(folder):
            remove_folder(folder)
