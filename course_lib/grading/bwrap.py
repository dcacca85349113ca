"""The sandbox's walls: whether ``bwrap`` works here and the command that builds them.

:func:`bwrap_command` lays out what the collector sees (:mod:`~course_lib.grading.sandbox`
says why each wall is there): system files, Python, the environment and ``course_lib``
read-only, with the grader's folder showing the stand-in
:mod:`course_lib.submission.grading` and each module that holds one of the lab's answers
showing a copy without it (:mod:`~course_lib.grading.hiding`); a private ``/tmp``; one
writable folder.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import course_lib.grading


def setting():
    return os.environ.get("COURSE_LIB_SANDBOX", "auto").strip().lower()


@functools.lru_cache(maxsize=None)
def bwrap_works():
    """Whether ``bwrap`` is installed and can make its namespaces here (tried once)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False
    try:
        done = subprocess.run([bwrap, "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent",
                               "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def sandbox_available():
    """Whether submissions will run sandboxed (``COURSE_LIB_SANDBOX`` and ``bwrap``)."""
    chosen = setting()
    if chosen in ("0", "off", "no", "false"):
        return False
    if bwrap_works():
        return True
    if chosen in ("1", "on", "yes", "true"):
        raise RuntimeError("COURSE_LIB_SANDBOX=1 but bwrap is missing or cannot create "
                           "namespaces here (install Debian's bubblewrap)")
    return False


def _read_only_paths():
    """What the collector needs to see: system files, Python, the environment, course_lib."""
    import course_lib
    import matplotlib

    paths = {"/usr", "/etc", "/sys", "/opt", "/bin", "/lib", "/lib64", "/lib32", "/sbin",
             sys.prefix, sys.base_prefix, sys.exec_prefix,
             str(Path(course_lib.__file__).resolve().parent),
             str(Path(matplotlib.__file__).resolve().parent.parent)}
    return sorted(p for p in paths if os.path.lexists(p))


def bwrap_command(workdir, env, mounts=()):
    command = ["bwrap", "--die-with-parent", "--new-session", "--unshare-all",
               "--hostname", "localhost", "--uid", "65534", "--gid", "65534", "--clearenv",
               # the private /tmp first: the course (or its environment) may live under it
               "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]
    for path in _read_only_paths():
        if os.path.islink(path) and path.count("/") == 1:  # /bin -> usr/bin on merged /usr
            command += ["--symlink", os.readlink(path), path]
        else:
            command += ["--ro-bind", path, path]
    # the grader is not in the sandbox: its folder shows the stand-in instead
    package = Path(course_lib.grading.__file__).resolve().parent
    command += ["--ro-bind", str(package.parent / "submission" / "grading"), str(package)]
    # the lab's own answers: each module holding one shows a copy without it
    for copy, original in mounts:
        command += ["--ro-bind", str(copy), str(original)]
    command += ["--dir", "/tmp/mpl", "--dir", "/tmp/home"]
    fonts = _font_cache()
    if fonts is not None:  # without it matplotlib rebuilds its font list: seconds per notebook
        command += ["--ro-bind", str(fonts), f"/tmp/mpl/{fonts.name}"]
    command += ["--bind", str(workdir), str(workdir), "--chdir", str(workdir)]
    for name, value in env.items():
        command += ["--setenv", name, value]
    return command


def _font_cache():
    import matplotlib

    found = sorted(Path(matplotlib.get_cachedir()).glob("fontlist-*.json"))
    return found[-1] if found else None
