"""``python -m course_lib.runtime [--nproc N] [--backend B] [--timeout S] script.py ARGS``

Runs a plain script on N ranks of a fresh torchrun job, as cluster jobs do.
"""
from __future__ import annotations

import sys

from course_lib.runtime.launcher import LaunchError, run_script


def main(argv=None):
    """``python -m course_lib.runtime [--nproc N] [--backend B] [--timeout S] script.py ...``"""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m course_lib.runtime", description=main.__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    try:
        run_script(ns.script, *ns.args, nproc=ns.nproc, backend=ns.backend, timeout=ns.timeout)
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
