"""``course_lib.grading`` as a graded submission's sandbox has it: nothing of the grader.

When the gradebook grades a notebook, the sandbox mounts this folder where
``course_lib/grading/`` would be. Its check cells run in the judge, outside the
sandbox, so no harness, reference, case table, formula or message is needed here,
and none is here to import or to read. What the notebook's own cells use still
works: ``from course_lib.grading import checks, lab01`` (the setup cell) and
``checks.ready("Exercise 1.4")`` (a demo that skips code whose check failed, told by
the judge). A lab's check module is an empty stand-in: any name asked of it raises,
saying why; ``import course_lib.grading.lab01.predictions`` finds nothing.
"""
from . import checks  # noqa: F401  (relative: in the sandbox this folder is course_lib.grading)


class _Elsewhere:
    """A lab's check module, as the sandbox has it: a name and nothing behind it."""

    def __init__(self, name):
        self.__name__ = name

    def __getattr__(self, attr):
        raise AttributeError(f"{self.__name__}.{attr} is not in a graded submission's sandbox: "
                             f"the checks run in the gradebook's judge, outside it")

    def __repr__(self):
        return f"<{self.__name__}: the grader, not in this sandbox>"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Elsewhere(f"course_lib.grading.{name}")
