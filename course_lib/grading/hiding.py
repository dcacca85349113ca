"""The lab's own answers out of reach while it is graded: the sandbox's copies of the
modules that hold them (the judge's side of :mod:`course_lib.submission.hidden`).

For each item of the lab being graded, the registry (:mod:`~course_lib.grading.registry`)
names the library's implementation and, where a check compares with it, torch's
counterpart (``"module:qualname"``). :func:`overlays` writes, for every module holding
one, a copy of its source in which each such top-level definition is replaced by a
stand-in (:data:`STAND_IN`); the sandbox mounts each copy over the original file,
read-only. The code of the answer is not in the sandbox: it cannot be called, wrapped,
cloned, or read back with ``inspect.getsource``. The name still imports (the library's
modules import each other, and the package stays usable); any use raises, naming the
item::

    from course_lib.collectives.ring import all_reduce   # while Lab 01 is graded
    all_reduce(t)   # ImportError: course_lib.collectives.ring.all_reduce is the library's
                    # answer to Exercise 1.4, not available while its lab is graded ...

A class stand-in refuses to be built (its subclasses too), not to be subclassed, so
library modules deriving from it still import; the judge's reading of the source
refuses a student's subclass.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from course_lib.grading.registry import REFERENCES

# Written into each copy itself: a copy of one of torch's modules runs while torch is
# being imported, before anything of course_lib could be.
STAND_IN = '''
def _course_hidden(name, item, kind):
    message = (f"{name} is the library's answer to {item}, not available while its lab is "
               f"graded: the exercise is to write it yourself")

    def refuse(*args, **kwargs):
        raise ImportError(message)

    if kind == "class":
        return type(name.rsplit(".", 1)[-1], (), {"__new__": refuse, "__doc__": message})
    refuse.__name__ = refuse.__qualname__ = name.rsplit(".", 1)[-1]
    refuse.__doc__ = message
    return refuse

'''


# Answers to one item that the lab hands the student for another item of the same lab.
# The sandbox hides them like every answer; the requests of the item they are handed to
# run on ranks, where the judge puts them back by value (:func:`.apart.given`), and no
# item they answer is decided on ranks that held them (:class:`.apart.Account`).
GIVEN = {
    "Exercise 2.3": ("course_lib.ddp.buckets:Bucket",),  # the frame's flat buffers (2.6's)
    # plan.fits counts each mesh's model state with Prediction 6.2's formula
    "Exercise 6.3": ("course_lib.memory.estimate:model_state_bytes", "course_lib.mesh:ParallelDims"),
    "Exercise 6.4": ("course_lib.mesh:ParallelDims",),  # the mesh of Exercise 6.1
    # state_of cuts an FSDP shard into the boxes of Exercise 8.1
    "Exercise 8.5": ("course_lib.checkpoint.boxes:boxes_of_flat_range",),
}


def items_of(exercises):
    """{module: {name: item}} of the top-level definitions to hide for ``exercises``
    (methods and nested names are covered by hiding what holds them)."""
    found = {}
    for item in exercises:
        for entry in REFERENCES.get(item, ()):
            module, _, qualname = entry.partition(":")
            found.setdefault(module, {}).setdefault(qualname.split(".")[0], item)
    return found


def _source_file(module):
    spec = importlib.util.find_spec(module)
    origin = getattr(spec, "origin", None) if spec else None
    return Path(origin) if origin and origin.endswith(".py") else None


def hide_in_source(source, module, names):
    """``source`` with the top-level definitions of ``names`` ({name: item}) replaced by
    stand-ins; returns (new source, names replaced)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    spans, done = [], []
    for node in tree.body:
        targets = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            targets = [node.name]
        elif isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        hit = [t for t in targets if t in names]
        if not hit:
            continue
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        stand_in = "".join(f"{name} = _course_hidden({module + '.' + name!r}, "
                           f"{names[name]!r}, {kind!r})\n" for name in hit)
        spans.append((first - 1, node.end_lineno, stand_in))
        done += hit
    for start, end, text in sorted(spans, reverse=True):
        lines[start:end] = [text]
    body = "".join(lines)
    # after a module docstring and `from __future__` imports, which must come first
    insert_at = 0
    for node in tree.body:
        is_doc = isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None),
                                                           ast.Constant)
        if is_doc or (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            insert_at = node.end_lineno
        else:
            break
    head = body.splitlines(keepends=True)
    return "".join(head[:insert_at]) + STAND_IN + "".join(head[insert_at:]), done


def overlays(exercises, into):
    """Write the hiding copies for ``exercises`` under ``into``; returns
    [(copy, original file)] for the sandbox to mount read-only."""
    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    mounts = []
    for module, names in sorted(items_of(exercises).items()):
        original = _source_file(module)
        if original is None:
            continue
        text, done = hide_in_source(original.read_text(), module, names)
        if not done:
            continue
        copy = into / f"{module}.py"
        copy.write_text(text)
        mounts.append((copy, original.resolve()))
    return mounts
