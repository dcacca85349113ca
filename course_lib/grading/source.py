"""The judge's reading of a submission's code: stubs and course_lib's own implementations.

The gradebook's judge never runs a student's code, but it reads it: the code
cells as text, compiled (never executed) to bytecode. For the names a check
cell hands to a check (``lab01.check_ring_all_reduce(ring_all_reduce)``),
:class:`Source` finds the cell that last defined each before the check and,
from there, every cell whose definitions that code loads by name:

- :meth:`Source.stubs`: a definition that still raises the lab's stub
  (:func:`~course_lib.grading.stubs.code_is_stub` on its code objects);
- :meth:`Source.references`: a name or attribute chain, through the notebook's
  imports, that is course_lib's implementation of the exercise
  (:mod:`~course_lib.grading.references`): in a function's body, a default
  argument, a decorator, a base class, anything the defining cell runs, an
  import in a body, or ``getattr(module, "name")`` with a constant name.

Names built at run time (``"ring" + "_shift"``, ``exec`` of a string) are not
followed; :mod:`~course_lib.grading.integrity` flags such code for a person to read.
"""
from __future__ import annotations

import ast
import dis
import importlib
import inspect
import types

from course_lib.grading.integrity import python_source
from course_lib.grading.references import references
from course_lib.grading.stubs import code_is_stub

_SKIP = {"CACHE", "PRECALL", "PUSH_NULL", "EXTENDED_ARG", "NOP", "RESUME"}


class _Cell:
    def __init__(self, index, source):
        self.index = index
        self.codes, self.defines, self.imports = [], {}, {}
        for text in python_source(source):
            try:
                tree = ast.parse(text)
                code = compile(tree, f"<cell {index + 1}>", "exec")
            except (SyntaxError, ValueError):
                continue
            self.codes.append(code)
            for node in tree.body:
                for name in _bound_names(node):
                    self.defines[name] = node
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        name = alias.asname or alias.name.split(".")[0]
                        self.imports[name] = alias.name if alias.asname else name
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    for alias in node.names:
                        if alias.name != "*":
                            self.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"


def _bound_names(node):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        return [a.asname or a.name.split(".")[0] for a in node.names if a.name != "*"]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def code_objects(code):
    """``code`` and every code object nested in it (its functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from code_objects(const)


def _resolve(path):
    """The course_lib object a dotted path names, or None (only course_lib is imported)."""
    if not path or not path.startswith("course_lib"):
        return None
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            try:
                obj = inspect.getattr_static(obj, part)
            except AttributeError:
                return None
        return obj
    return None


class Source:
    """The code cells of a submission, ``[(index, source)]`` in notebook order."""

    def __init__(self, cells):
        self.cells = [_Cell(index, source) for index, source in cells]

    def _defining(self, name, before):
        found = [c for c in self.cells if c.index < before and name in c.defines]
        return found[-1] if found else None

    def _aliases(self, before):
        aliases = {}
        for cell in self.cells:
            if cell.index < before:
                aliases.update(cell.imports)
        return aliases

    def stubs(self, names, before):
        """The ``names`` whose last definition before cell ``before`` holds a stub."""
        found = []
        for name in names:
            cell = self._defining(name, before)
            if cell is None:
                continue
            node = cell.defines[name]
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            inner = [c for code in cell.codes for c in code_objects(code)
                     if c.co_firstlineno in lines and c.co_name != "<module>"]
            if any(code_is_stub(c) for c in inner):
                found.append(name)
        return found

    def references(self, exercise, names, before):
        """Lines saying how the code behind ``names`` reaches course_lib's implementation of
        ``exercise`` (empty when it does not)."""
        refs = references(exercise)
        if not refs:
            return []
        by_id = {id(obj): name for obj, name in refs.items()}
        classes = [(obj, name) for obj, name in refs.items() if inspect.isclass(obj)]
        aliases = self._aliases(before)
        found, seen = [], set()
        todo = [(name, self._defining(name, before)) for name in names]
        while todo:
            label, cell = todo.pop()
            if cell is None or cell.index in seen:
                continue
            seen.add(cell.index)
            for code in cell.codes:
                for path, how in _reached(code, aliases):
                    obj = _resolve(path)
                    hit = by_id.get(id(obj)) if obj is not None else None
                    if hit is None and inspect.isclass(obj):
                        hit = next((n for ref, n in classes if obj is not ref and
                                    issubclass(obj, ref)), None)
                    if hit is not None:
                        line = f"{label} {how} {hit}"
                        if line not in found:
                            found.append(line)
                    elif "." not in path and path not in aliases:
                        # a name the notebook defines: follow its definition (an imported
                        # name is already resolved through ``aliases``; following it would
                        # read every other import of its cell)
                        todo.append((f"{label} -> {path}", self._defining(path, before)))
        return found


def _reached(code, aliases):
    """(dotted path, how) for every name and attribute chain ``code`` loads, its imports
    and ``getattr(x, "constant")``; paths start from the notebook's import aliases."""
    for each in code_objects(code):
        chain = None  # the chain the previous instruction left on the stack
        for ins in (i for i in dis.get_instructions(each) if i.opname not in _SKIP):
            if ins.opname in ("LOAD_NAME", "LOAD_GLOBAL"):
                chain = aliases.get(ins.argval, ins.argval)
                yield chain, "uses"
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and chain is not None:
                chain = f"{chain}.{ins.argval}"
                yield chain, "uses"
            elif ins.opname == "IMPORT_NAME" and isinstance(ins.argval, str):
                chain = None
                if ins.argval.startswith("course_lib"):
                    for name in each.co_names:
                        yield f"{ins.argval}.{name}", "imports"
            elif ins.opname == "LOAD_CONST" and chain is not None and \
                    isinstance(ins.argval, str) and ins.argval.isidentifier():
                yield f"{chain}.{ins.argval}", "reaches by name"  # getattr(module, "name")
                chain = None
            else:
                chain = None
