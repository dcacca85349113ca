"""Which course_lib objects implement each exercise, and spotting a student's use of them.

course_lib holds a working version of nearly everything the labs ask students to
write. A submission that hands the library's own version to a check (or a thin
wrapper that calls it) would pass without the student having written anything,
so :func:`reference_use` looks for it and the check fails, saying so::

    reference_use("Exercise 0.3", [ring_shift])
    # ['ring_shift is course_lib.collectives.p2p.ring_shift']

Entries (:mod:`course_lib.grading.registry`) are ``"module:qualname"`` strings, imported
only when a check asks, so a lab's registry costs nothing until it is graded and
registering a lab is one line. An entry that no longer resolves (the library moved
something) is skipped with a warning rather than breaking students' checks; a test
keeps them valid.

What is recognised, starting from the objects a check is handed (a job function,
its arguments, and what they close over, as :mod:`course_lib.grading.stubs`
walks them):

- the reference object itself, or a function that shares its code object, or a
  class deriving from a reference class;
- a function or method written outside course_lib that reaches a reference by a
  global name or an attribute chain from one (``reference.all_reduce``,
  ``course_lib.collectives.ring.all_reduce``), or imports it in its body, or calls
  another such function of the student's.

Lookups built at run time (``getattr`` with a computed name, ``importlib``,
``exec``) are not followed.
"""
from __future__ import annotations

import dis
import functools
import importlib
import inspect
import sys
import types
import warnings

from course_lib.grading import ids
from course_lib.grading.registry import REFERENCES

_LOADS = {"LOAD_GLOBAL", "LOAD_NAME"}
_ATTRS = {"LOAD_ATTR", "LOAD_METHOD"}
_warned = set()


_key = ids.normalize


def resolve(entry):
    """The object named by ``"module:qualname"`` (raises ImportError/AttributeError)."""
    module, _, qualname = entry.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def references(exercise):
    """{object: "module.qualname"} for ``exercise``; entries that do not resolve are
    skipped, with one warning each."""
    found = {}
    for entry in REFERENCES.get(_key(exercise), ()):
        try:
            found[resolve(entry)] = entry.replace(":", ".")
        except (ImportError, AttributeError) as exc:
            if entry not in _warned:
                _warned.add(entry)
                warnings.warn(f"course_lib.grading.references: {entry} does not resolve ({exc})",
                              stacklevel=2)
    return found


def reference_modules(exercises):
    """Names of the modules that define a reference of any of ``exercises``."""
    return {entry.partition(":")[0] for ex in exercises for entry in REFERENCES.get(_key(ex), ())}


def _from_course_lib(obj):
    return str(getattr(obj, "__module__", "") or "").startswith("course_lib")


def _student_code(obj):
    """Written by the student: in the notebook (``__main__``) or a file of theirs, not in
    course_lib, an installed package or the standard library (which are not searched)."""
    module = getattr(obj, "__module__", None)
    if not module or module == "__main__":
        return True
    if module.startswith("course_lib"):
        return False
    path = getattr(sys.modules.get(module), "__file__", None)
    if not path:
        return True
    return not ("site-packages" in path or path.startswith((sys.base_prefix, sys.prefix)))


def _codes(obj):
    """Code objects of a reference: a function's, or every method's of a class (not of
    classes nested in it: an autograd Function and its ``_backward_cls`` name each other).
    Decorated ones are unwrapped: the wrapper's code (``contextlib.contextmanager``'s,
    ``torch.no_grad``'s) is shared by every function so decorated, the student's too."""
    if inspect.isclass(obj):
        members = [inspect.unwrap(getattr(m, "__func__", m)) for m in vars(obj).values()]
        return [m.__code__ for m in members if inspect.isfunction(m)]
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    return [obj.__code__] if inspect.isfunction(obj) else []


class _Search:
    def __init__(self, refs):
        self.refs = {id(obj): name for obj, name in refs.items()}
        self.classes = [(obj, name) for obj, name in refs.items() if inspect.isclass(obj)]
        self.codes = {code: name for obj, name in refs.items() for code in _codes(obj)}
        self.seen, self.found = set(), []

    def note(self, path, what):
        line = f"{path} {what}"
        if line not in self.found:
            self.found.append(line)

    def is_reference(self, obj, path, verb):
        name = self.refs.get(id(obj))
        if name is None:
            return False
        self.note(path, f"{verb} {name}")
        return True

    def walk(self, obj, path, depth):
        if depth <= 0 or id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        if self.is_reference(obj, path, "is"):
            return
        if isinstance(obj, functools.partial):
            for inner in (obj.func, *obj.args, *obj.keywords.values()):
                self.walk(inner, path, depth - 1)
            return
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None and not isinstance(obj, types.ModuleType):
            self.walk(wrapped, path, depth - 1)
        func = getattr(obj, "__func__", obj)
        if inspect.isfunction(func):
            self.function(func, path, depth)
        elif inspect.isclass(obj):
            self.cls(obj, path, depth)

    def function(self, func, path, depth):
        name = self.codes.get(func.__code__)
        if name is not None:
            self.note(path, f"has the code of {name}")
            return
        library = _from_course_lib(func)
        if not (library or _student_code(func)):
            return
        for var, cell in zip(func.__code__.co_freevars, func.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not assigned yet
                continue
            # a check's job closes over the student's function: name it as the check does
            self.walk(value, var if library else f"{path} -> {var}", depth - 1)
        if not library:  # the library's own globals are its business
            self.code(func.__code__, func.__globals__, path, depth)

    def cls(self, cls, path, depth):
        if not _student_code(cls):
            return
        for ref, name in self.classes:
            if cls is not ref and issubclass(cls, ref):
                self.note(path, f"derives from {name}")
                return
        for attr, member in vars(cls).items():
            member = getattr(member, "__func__", getattr(member, "fget", member))
            if inspect.isfunction(member):
                self.walk(member, f"{path}.{attr}", depth - 1)

    def code(self, code, namespace, path, depth):
        """Globals and attribute chains the bytecode loads, and imports in its body."""
        builtins = namespace.get("__builtins__", {})
        builtins = vars(builtins) if isinstance(builtins, types.ModuleType) else builtins
        chain, imported = None, None
        for ins in dis.get_instructions(code):
            if ins.opname in _LOADS:
                chain = self.lookup(namespace, builtins, ins.argval)
                self.reached(chain, path, depth)
            elif ins.opname in _ATTRS and chain is not None:
                chain = _attribute(chain, ins.argval)
                self.reached(chain, path, depth)
            elif ins.opname == "IMPORT_NAME":
                imported = sys.modules.get(ins.argval)
                chain = None
                if imported is not None and ins.argval.startswith("course_lib"):
                    for part in code.co_names:
                        self.reached(_attribute(imported, part), path, depth)
            elif ins.opname == "IMPORT_FROM" and imported is not None:
                self.reached(_attribute(imported, ins.argval), path, depth)
            elif ins.opname not in ("CACHE", "PRECALL", "PUSH_NULL", "EXTENDED_ARG"):
                chain = None
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self.code(const, namespace, path, depth)

    @staticmethod
    def lookup(namespace, builtins, name):
        if name in namespace:
            return namespace[name]
        return builtins.get(name)

    def reached(self, obj, path, depth):
        if obj is None or self.is_reference(obj, path, "uses"):
            return
        func = getattr(obj, "__func__", obj)
        if (inspect.isfunction(func) or inspect.isclass(func)) and _student_code(func):
            self.walk(func, f"{path} -> {getattr(func, '__qualname__', '?')}", depth - 1)


def _attribute(obj, name):
    """``getattr`` on modules and classes only: an arbitrary object's property could run
    code, and a chain through a value is not a name the student wrote."""
    if obj is None or not (isinstance(obj, types.ModuleType) or inspect.isclass(obj)):
        return None
    try:
        return inspect.getattr_static(obj, name)
    except AttributeError:
        if isinstance(obj, types.ModuleType):  # a submodule not imported as an attribute yet
            return sys.modules.get(f"{obj.__name__}.{name}")
        return None


def reference_use(exercise, objects, depth=5):
    """Lines saying how ``objects`` (named ``{name: obj}`` or a sequence) are, or
    reach, course_lib's implementation of ``exercise``; empty when they do not."""
    refs = references(exercise)
    if not refs:
        return []
    named = objects.items() if isinstance(objects, dict) else (
        (getattr(o, "__qualname__", None) or getattr(o, "__name__", None) or type(o).__name__, o)
        for o in objects)
    search = _Search(refs)
    for name, obj in named:
        search.walk(obj, name, depth)
    return search.found
