"""What the judge sends the sandbox by value: the grader's code, and the library's where
the lab being graded hides it.

While a lab is graded the sandbox holds its answers only as stand-ins
(:mod:`~course_lib.grading.hiding`), yet a check's harness may be built on one of them
(Exercise 4.3's check cuts the model with the library's ``partition``, which is 4.4's
answer; 2.4 trains the library's DDP, 2.3's). Such a piece travels inside the request,
as code, from the judge: it runs where the harness runs, and the sandbox has nothing of
it to import by name.

:func:`shipped` finds those pieces: the hidden answers, and every function or class of
the library whose code reaches one (through a global name, a default, a closure, a base
class or a method), to a fixed point. Everything else of the library travels by name as
usual, so the student's objects and the harness's still share one ``ShardedTensor``, one
``GPT``. A piece that imports a hidden one *inside* its body, or reaches it as a module's
attribute, cannot be shipped (the import runs in the sandbox; a module travels by
name): :func:`unshippable` lists those, and a test keeps it empty.

A piece sent this way is an answer within reach of the student's code that runs beside
it; :mod:`~course_lib.grading.apart` keeps that from reaching an item not yet decided.
"""
from __future__ import annotations

import dis
import functools
import importlib
import io
import pkgutil
import sys
import types

from cloudpickle import cloudpickle as _cloudpickle

from course_lib.grading.hiding import items_of
from course_lib.grading.registry import REFERENCES
from course_lib.grading.source import code_objects
from course_lib.runtime import pickling

_SKIP = ("course_lib.grading", "course_lib.submission")

# What the judge sends travels by value: a check's harness, the grader's own function,
# is rebuilt in the sandbox from its code, where no course_lib.grading exists to look
# it up by name (and nothing the student's code replaced there could be found instead).
_cloudpickle.register_pickle_by_value(sys.modules["course_lib.grading"])


def _hidden(exercises):
    """{id: object} of the library's (not torch's) hidden answers for ``exercises``."""
    found = {}
    for module, names in items_of(exercises).items():
        if module.startswith("course_lib."):
            loaded = importlib.import_module(module)
            for name in names:
                if hasattr(loaded, name):
                    found[id(getattr(loaded, name))] = getattr(loaded, name)
    return found


def _functions_of(cls):
    """The functions a class's own namespace holds (methods, static and class methods,
    properties' accessors)."""
    for value in vars(cls).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            yield from (f for f in (value.fget, value.fset, value.fdel) if f is not None)
        elif isinstance(value, types.FunctionType):
            yield value


def _reaches(obj):
    """What ``obj`` (a function or a class) refers to when it runs."""
    if isinstance(obj, type):
        yield from obj.__mro__[1:]
        for fn in _functions_of(obj):
            yield from _reaches(fn)
        return
    names = {n for code in code_objects(obj.__code__) for n in code.co_names}
    for name in names:
        value = obj.__globals__.get(name)
        if isinstance(value, types.ModuleType):  # module.attr: any attribute the code names
            yield from (getattr(value, n) for n in names if hasattr(value, n))
        elif value is not None:
            yield value
    yield from obj.__defaults__ or ()
    yield from (obj.__kwdefaults__ or {}).values()
    for cell in obj.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue


@functools.lru_cache(maxsize=1)
def _library_modules():
    """Every module of the library (imported once: what a harness reaches must not depend
    on what happens to be imported when a message is pickled)."""
    import course_lib

    names = [m.name for m in pkgutil.walk_packages(course_lib.__path__, "course_lib.")
             if not m.name.startswith(_SKIP) and not m.name.endswith("__main__")]
    return [importlib.import_module(name) for name in names]


def _library_definitions():
    """Every function and class defined at the top of a module of the library."""
    for module in _library_modules():
        name = module.__name__
        for value in list(vars(module).values()):
            if isinstance(value, (type, types.FunctionType)) and \
                    getattr(value, "__module__", None) == name:
                yield value


def shipped(exercises):
    """{id: object} of the library's functions and classes that travel by value while
    ``exercises`` are graded (a class brings its methods)."""
    return _shipped(tuple(exercises))


@functools.lru_cache(maxsize=64)
def _shipped(exercises):
    ship = _hidden(exercises)
    if not ship:
        return {}
    rest = {id(v): v for v in _library_definitions() if id(v) not in ship}
    reaches = {key: {id(r) for r in _reaches(obj)} for key, obj in rest.items()}
    grew = True
    while grew:
        grew = False
        for key in list(rest):
            if reaches[key] & ship.keys():
                ship[key] = rest.pop(key)
                grew = True
    for cls in [v for v in ship.values() if isinstance(v, type)]:
        ship.update({id(fn): fn for fn in _functions_of(cls)})
    return ship


def unshippable(exercises, functions):
    """``[(function, what)]``: the ``functions`` (a check's harness, or shipped code) that
    reach a piece shipped for ``exercises`` in a way that cannot travel: an import in
    their body (it runs in the sandbox and finds the stand-in), or an attribute of a
    module (``reshard.train_and_save``: a module travels by name). Import the piece by
    name at the top of the module instead."""
    ship = shipped(exercises)
    found = []
    for fn in functions:
        where = f"{fn.__module__}:{fn.__qualname__}"
        for code in code_objects(fn.__code__):
            module = None
            for op in dis.get_instructions(code):
                if op.opname == "IMPORT_NAME":
                    module = sys.modules.get(op.argval)
                elif op.opname == "IMPORT_FROM" and _holds(getattr(module, op.argval, None), ship):
                    found.append((where, f"imports {module.__name__}.{op.argval}"))
                elif op.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                    module = fn.__globals__.get(op.argval)
                elif op.opname in ("LOAD_ATTR", "LOAD_METHOD") and \
                        isinstance(module, types.ModuleType) and \
                        id(getattr(module, op.argval, None)) in ship:
                    found.append((where, f"reaches {module.__name__}.{op.argval}"))
                    module = None
                else:
                    module = None if op.opname not in ("IMPORT_FROM", "POP_TOP", "STORE_FAST",
                                                        "STORE_NAME") else module
    return found


def _holds(value, ship):
    """Whether ``value`` is shipped, or a module defining something shipped."""
    if isinstance(value, types.ModuleType):
        return any(getattr(v, "__module__", None) == value.__name__ for v in ship.values())
    return id(value) in ship


class _Pickler(pickling.Pickler):
    def __init__(self, file, ship):
        super().__init__(file)
        self._ship, self.sent = ship, set()  # ids of what went by value

    def reducer_override(self, obj):
        if id(obj) in self._ship and not pickling.once_differentiable_wrapper(obj):
            self.sent.add(id(obj))
            if isinstance(obj, type):
                reduced = _cloudpickle._dynamic_class_reduce(obj)
                # an autograd Function's metaclass makes its backward class anew when the
                # class is rebuilt; the old one does not travel
                reduced[2][0].pop("_backward_cls", None)
                return reduced
            return self._dynamic_function_reduce(obj)
        return super().reducer_override(obj)


def dumps(message, exercises):
    """``message`` pickled for the sandbox of a lab grading ``exercises``."""
    buffer = io.BytesIO()
    _Pickler(buffer, shipped(exercises)).dump(message)
    return buffer.getvalue()


def answers_carried(message, exercises):
    """The items of ``exercises`` whose answers :func:`dumps` would send inside
    ``message`` (Exercise 2.4's request trains the library's DDP, and with it carries
    Bucket, the answer to 2.6)."""
    pickler = _Pickler(io.BytesIO(), shipped(exercises))
    pickler.dump(message)
    answered = _answered_by(tuple(exercises))
    return {item for sent in pickler.sent for item in answered.get(sent, ())}


@functools.lru_cache(maxsize=64)
def _answered_by(exercises):
    """{id: items} of the library's top-level answers to ``exercises`` (one answer may
    serve several items)."""
    found = {}
    for item in exercises:
        for entry in REFERENCES.get(item, ()):
            module, _, qualname = entry.partition(":")
            if module.startswith("course_lib."):
                obj = getattr(importlib.import_module(module), qualname.split(".")[0], None)
                # a class's code travels method by method too (a bound method, a partial)
                parts = [obj, *_functions_of(obj)] if isinstance(obj, type) else [obj]
                for part in parts if obj is not None else ():
                    found.setdefault(id(part), set()).add(item)
    return found
