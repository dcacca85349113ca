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


# Answers to one item that another item of the same lab is built on (given to the student,
# or run by that item's check on the student's side): these stay, and the judge's reading
# of the source is what refuses them for their own item. Each is a place where the lab
# hands the student a piece or a check still runs library code beside student code.
BUILT_ON = {
    "course_lib.ddp.buckets:Bucket": "Exercise 2.3 is given it (2.6 writes it from a blank page)",
    "course_lib.ddp.bucketed:DDP": "Exercises 2.4 and 2.5 run on the library's DDP",
    "course_lib.ddp.naive:_DataParallel": "the library's DDP (Exercises 2.4, 2.5) derives from it",
    "course_lib.ddp.buckets:assign_buckets": "the library's DDP (Exercises 2.4, 2.5) buckets with it",
    "course_lib.fsdp.unit:flatten_and_shard": "Exercises 3.6 and 3.7 run on the library's unit",
    "course_lib.fsdp.unit:GatherShards": "Exercise 3.7 runs on the library's unit",
    "course_lib.fsdp.unit:free_between_passes": "Exercise 3.8 runs on the library's unit",
    "course_lib.pipeline.schedules:gpipe": "Exercise 4.3's check runs a GPipe schedule",
    "course_lib.pipeline.partition:partition": "Exercise 4.3's check partitions the model",
    "course_lib.pipeline.schedules:one_f_one_b": "Exercise 4.5 runs the library's 1F1B",
    "course_lib.tp.blocks:ParallelAttention": "Exercise 5.4's check builds its heads from it",
    "course_lib.tp.layers:ColumnParallelLinear": "the library's attention (5.4) is built on it",
    "course_lib.tp.layers:RowParallelLinear": "the library's attention (5.4) is built on it",
    "course_lib.tp.layers:column_shard": "the library's layers (5.4) are built on it",
    "course_lib.tp.operators:CopyToTP": "the library's layers (5.4) are built on it",
    "course_lib.tp.operators:ReduceFromTP": "the library's layers (5.4) are built on it",
    "course_lib.tp.operators:copy_to_tp": "the library's layers (5.4) are built on it",
    "course_lib.tp.operators:reduce_from_tp": "the library's layers (5.4) are built on it",
    "course_lib.memory.estimate:model_state_bytes": "Exercise 6.3's planner is given it",
    "course_lib.mesh:ParallelDims": "Exercise 6.4's three-dimensional step is built on it",
    "course_lib.checkpoint.load:_load_tensor": "Exercise 8.3's check loads the student's save",
    "course_lib.checkpoint.boxes:boxes_of_flat_range": "Exercises 8.4 and 8.5 cut FSDP shards",
    "course_lib.checkpoint.boxes:_boxes": "Exercises 8.4 and 8.5 cut FSDP shards",
    "course_lib.checkpoint.boxes:overlap": "Exercises 8.3-8.5 load through the library",
    "course_lib.checkpoint.boxes:byte_ranges": "Exercises 8.3-8.5 load through the library",
    "course_lib.checkpoint.boxes:_lines": "Exercises 8.3-8.5 load through the library",
    "course_lib.checkpoint.load:fill_box": "Exercise 8.3's check loads the student's save",
    "course_lib.checkpoint.load:_read": "Exercise 8.3's check loads the student's save",
    "course_lib.checkpoint.save:save": "Exercises 8.4 and 8.5 save through the library",
}


def items_of(exercises):
    """{module: {name: item}} of the top-level definitions to hide for ``exercises``
    (methods and nested names are covered by hiding what holds them)."""
    found = {}
    for item in exercises:
        for entry in REFERENCES.get(item, ()):
            if entry in BUILT_ON:
                continue
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
