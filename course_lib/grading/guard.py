"""In a grading kernel: undoing what a submission's cells did to course_lib and torch.

A submission's cells run in the same kernel as the check cells, so a cell can
replace a check helper (``checks.expect_close = lambda *a, **k: None``), a check
function, or a comparison the checks rely on (``torch.testing.assert_close``).
The grader runs three short cells of its own in the kernel (they are not stored
in the executed notebook):

- :func:`install`, first: imports the lab's check modules and records every
  function, class and module bound in course_lib's modules and classes, the
  torch functions and ``torch.Tensor`` methods the checks compare with, a few
  builtins, and ``sys.stdout``/``sys.stderr``;
- :func:`before_check`, before each restored check cell: puts back anything
  rebound or whose code was swapped since, reloads ``course_lib.grading.checks``
  and the lab's check modules (new function objects, from their source), and
  rebinds the names the check cell uses (``checks``, ``lab00``) in the user
  namespace;
- :func:`after_check`, after it: reports (and undoes) changes made while the
  check ran, i.e. by the student's code the check called in this process: the
  grader fails that exercise.

Each prints one line, ``COURSE_LIB_GUARD {json}``, that the grader reads.

This is not a sandbox: anything in the kernel can reach this module too. It
undoes the patches a student can make without studying the grader, and the
grader's static scan (:mod:`course_lib.grading.integrity`) flags the attempt.
"""
from __future__ import annotations

import builtins
import importlib
import json
import sys
import types
import warnings

MARK = "COURSE_LIB_GUARD "
# Only what the checks compare with: other libraries rebind torch functions when imported
# (Lightning wraps torch.manual_seed and torch.compile), which is nobody's tampering.
PROTECTED = {
    "builtins": ("print", "__import__", "isinstance", "issubclass", "getattr", "setattr",
                 "hasattr", "repr", "str", "len", "type", "super", "abs", "all", "any", "sum",
                 "min", "max", "sorted", "zip", "range", "enumerate", "float", "int"),
    "torch": ("allclose", "equal", "isclose", "eq", "ne", "all", "any", "abs", "tensor",
              "testing", "is_tensor", "cat", "zeros", "full", "arange", "randn"),
    "torch.testing": ("assert_close",),
    "torch.Tensor": ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__",
                     "__len__", "__getitem__", "__sub__", "__matmul__", "eq", "ne", "equal",
                     "allclose", "isclose", "all", "any", "abs", "tolist", "item", "flatten",
                     "nonzero", "numel", "norm", "sum", "clone", "float", "double", "reshape",
                     "untyped_storage", "element_size", "shape", "dtype", "size"),
}
# reloaded before every check: the checks' common code, then the lab's modules
CORE = ("course_lib.grading.stubs", "course_lib.grading.references", "course_lib.grading.checks")

_MISSING = object()
_state = None


class _State:
    def __init__(self, check_modules):
        self.check_modules = list(check_modules)
        self.records = {}  # (owner name, attribute) -> (owner, value, code, defaults, kwdefaults)
        self.stdout, self.stderr = sys.stdout, sys.stderr


def _tracked(value):
    return callable(value) or isinstance(value, (types.ModuleType, staticmethod, classmethod,
                                                 property))


def _parts(value):
    func = getattr(value, "__func__", value)
    if isinstance(func, types.FunctionType):
        return func.__code__, func.__defaults__, func.__kwdefaults__
    return None, None, None


def _owners():
    """(name, module or class) pairs whose bindings are protected."""
    owners = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "course_lib" or name.startswith("course_lib.")):
            continue
        owners.append((name, module))
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                owners.append((f"{name}.{attr}", value))
    return owners


def _protected():
    """(name, owner, attributes) for the builtins and torch names in PROTECTED."""
    torch = sys.modules.get("torch")
    owners = {"builtins": builtins, "torch": torch,
              "torch.testing": sys.modules.get("torch.testing"),
              "torch.Tensor": getattr(torch, "Tensor", None)}
    return [(name, owners[name], attrs) for name, attrs in PROTECTED.items()
            if owners[name] is not None]


def _remember(state, owner_name, owner, names=None):
    own = vars(owner)
    with warnings.catch_warnings():  # deprecated objects warn when inspected
        warnings.simplefilter("ignore")
        for attr in (own if names is None else names):
            # a name the owner only inherits (torch.Tensor.__eq__ comes from a C base):
            # recorded as missing, so that one set on the class later is removed
            value = own.get(attr, _MISSING)
            if names is not None or _tracked(value):
                state.records[(owner_name, attr)] = (owner, value, *_parts(value))


def _snapshot(state, only=None):
    """Record the owners not recorded yet (``only``: re-record these module names)."""
    known = {owner_name for owner_name, _ in state.records}
    for owner_name, owner in _owners():
        module_name = owner_name if isinstance(owner, types.ModuleType) else owner.__module__
        if only is not None:
            if module_name not in only:
                continue
            for key in [k for k in state.records if k[0] == owner_name]:
                del state.records[key]
        elif owner_name in known:
            continue
        _remember(state, owner_name, owner)
    if only is None:
        for owner_name, owner, names in _protected():
            if owner_name not in known:
                _remember(state, owner_name, owner, names)


def _restore(state):
    """Put back every recorded binding that changed; one line per change."""
    changes = []
    for (owner_name, attr), (owner, value, code, defaults, kwdefaults) in state.records.items():
        current = vars(owner).get(attr, _MISSING)
        if current is not value:
            changes.append(f"{owner_name}.{attr} was " + ("deleted" if current is _MISSING else
                                                          "set" if value is _MISSING else
                                                          "replaced"))
            if value is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)
        func = getattr(value, "__func__", value)
        if code is not None and (func.__code__, func.__defaults__, func.__kwdefaults__) != \
                (code, defaults, kwdefaults):
            changes.append(f"{owner_name}.{attr} had its code or defaults changed")
            func.__code__, func.__defaults__, func.__kwdefaults__ = code, defaults, kwdefaults
    for stream in ("stdout", "stderr"):
        if getattr(sys, stream) is not getattr(state, stream):
            changes.append(f"sys.{stream} was replaced")
            setattr(sys, stream, getattr(state, stream))
    return changes


def _emit(event, **fields):
    print(MARK + json.dumps({"event": event, **fields}), flush=True)


def install(check_modules):
    """First thing in the kernel: import ``check_modules`` and record what to protect."""
    global _state
    for name in (*CORE, *check_modules):
        importlib.import_module(name)
    _state = _State(check_modules)
    _snapshot(_state)
    _emit("install", protected=len(_state.records))


def before_check(exercise, names):
    """Before the check cell of ``exercise``: undo, reload the check modules, and bind
    ``names`` ({name in the notebook: "module" or "module:attribute"}) in the user
    namespace to what the lab's imports bind them to."""
    if _state is None:
        raise RuntimeError("course_lib.grading.guard.install() was not run in this kernel")
    changes = _restore(_state)
    checks = sys.modules["course_lib.grading.checks"]
    outcomes, lock = checks._outcomes, checks._outcomes_lock
    reloaded = [*CORE, *(m for m in _state.check_modules if m not in CORE)]
    for name in reloaded:
        importlib.reload(sys.modules[name])
    checks._outcomes, checks._outcomes_lock = outcomes, lock  # ready() still knows the past
    _snapshot(_state)  # course_lib modules imported since install
    _snapshot(_state, only=set(reloaded))
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is not None:
        for name, target in names.items():  # "module" or "module:attribute"
            module, _, attr = target.partition(":")
            shell.user_ns[name] = getattr(sys.modules[module], attr) if attr else \
                sys.modules[module]
    _emit("before", exercise=exercise, changes=changes)


def after_check(exercise):
    """After the check cell of ``exercise``: what changed while it ran (undone)."""
    if _state is None:
        raise RuntimeError("course_lib.grading.guard.install() was not run in this kernel")
    _emit("after", exercise=exercise, changes=_restore(_state))
