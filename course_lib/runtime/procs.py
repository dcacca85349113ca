"""Finding and ending every process of a job, and nothing else.

torchrun's workers are not reliably in torchrun's process group, so a job is
identified two ways: the process tree under the torchrun process we started,
and an environment marker (``COURSE_LIB_JOB=<id>``) that every rank inherits.
Only processes carrying our job's id are ever signalled.
"""
from __future__ import annotations

import time

import psutil

MARKER = "COURSE_LIB_JOB"


def job_processes(job_id, root_pid=None):
    """Live processes of the job: descendants of ``root_pid`` and marked processes."""
    found = {}
    if root_pid is not None:
        try:
            root = psutil.Process(root_pid)
            for p in [root, *root.children(recursive=True)]:
                found[p.pid] = p
        except psutil.NoSuchProcess:
            pass
    for p in psutil.process_iter():
        if p.pid in found:
            continue
        try:
            if p.environ().get(MARKER) == job_id:
                found[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return list(found.values())


def marked(pids, job_id):
    """Those of ``pids`` that are alive and carry the job's marker (a pid that was reused
    by another process is not the job's)."""
    found = []
    for pid in pids:
        try:
            if psutil.Process(pid).environ().get(MARKER) == job_id:
                found.append(pid)
        except (psutil.Error, OSError):
            continue
    return found


def kill_job(proc, job_id, timeout=10.0):
    """SIGKILL torchrun (so it cannot restart anyone) and then every rank; wait
    until all are gone. Raises RuntimeError if something survives."""
    procs = job_processes(job_id, proc.pid)
    # torchrun first, so it does not react to its workers dying.
    procs.sort(key=lambda p: p.pid != proc.pid)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    alive = wait_dead(procs, timeout)
    try:
        proc.wait(timeout=timeout)
    except Exception:
        pass
    if proc.stdout is not None:
        proc.stdout.close()
    if alive:
        raise RuntimeError(f"processes of job {job_id} survived SIGKILL: {[p.pid for p in alive]}")


def wait_dead(processes, timeout):
    """Wait until each of ``processes`` has gone or is a zombie; return those still alive.
    A killed rank whose parent died with it is reaped by init, which may take its
    time (seconds here): dead is what matters, not reaped."""
    deadline = time.monotonic() + timeout
    alive = list(processes)
    while True:
        alive = [p for p in alive if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _running(proc):
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.Error:  # not ours to read: alive while its pid is
        return psutil.pid_exists(proc.pid)
