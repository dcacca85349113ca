"""Where the code a call shipped to its ranks came from, for quoting it back.

cloudpickle rebuilds a notebook's functions on the ranks with the file name
``<dynamic-code>`` (the notebook's own file names mean nothing there), and a
``%%torchrun`` cell runs as ``<%%torchrun cell>``. A hung rank's stack dump can
then say the function and the line, but not the file or the line of source.
:class:`Shipped` remembers, in the notebook, where each shipped function's code
came from (its file and the lines its code covers, found by walking the
function, its closures, the functions and classes it reaches by global name,
and the call's arguments) and the cell's source, and answers the two questions
the hang report asks: which file a frame is in, and what its line of source is::

    shipped = Shipped((fn, *args))
    shipped.file_of(frame)                 # "/tmp/ipykernel_7/3551.py" for a notebook cell
    shipped.source(frame)                  # "    dist.recv(t, (rank - 1) % world)"
"""
from __future__ import annotations

import inspect
import linecache
import types

DYNAMIC = "<dynamic-code>"
CELL = "<%%torchrun cell>"


class Shipped:
    def __init__(self, objects=(), cell=None, depth=4):
        self.cell = cell.splitlines() if cell is not None else None
        self.codes = {}  # function name -> [(file, lines)]
        self._seen = set()
        for obj in objects:
            self._visit(obj, depth)

    def _visit(self, obj, depth):
        if depth <= 0 or id(obj) in self._seen:
            return
        self._seen.add(id(obj))
        func = getattr(obj, "__func__", obj)
        if isinstance(func, types.FunctionType):
            self._code(func.__code__)
            for cell in func.__closure__ or ():
                try:
                    self._visit(cell.cell_contents, depth - 1)
                except ValueError:  # a cell not assigned yet
                    pass
            for name in func.__code__.co_names:  # helpers it calls by global name
                value = func.__globals__.get(name)
                if isinstance(value, (types.FunctionType, type)):
                    self._visit(value, depth - 1)
        elif inspect.isclass(obj) and obj.__module__ not in ("builtins",):
            for member in vars(obj).values():
                self._visit(member, depth - 1)
        elif isinstance(obj, (list, tuple)):
            for item in obj[:64]:
                self._visit(item, depth - 1)
        elif isinstance(obj, dict):
            for item in list(obj.values())[:64]:
                self._visit(item, depth - 1)

    def _code(self, code):
        lines = {line for _, _, line in code.co_lines() if line is not None}
        self.codes.setdefault(code.co_name, []).append((code.co_filename, lines))
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self._code(const)

    def file_of(self, frame):
        """The file a frame's code came from (its own file name when it is not shipped)."""
        if frame.file == DYNAMIC:
            for file, lines in self.codes.get(frame.func, ()):
                if frame.line in lines:
                    return file
        return frame.file

    def source(self, frame):
        """The frame's line of source, stripped ("" when unknown)."""
        if frame.file == CELL and self.cell is not None:
            return self.cell[frame.line - 1].strip() if 0 < frame.line <= len(self.cell) else ""
        return linecache.getline(self.file_of(frame), frame.line).strip()
