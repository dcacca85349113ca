"""Reading a submission's own cells for tampering (the gradebook's ``flags``).

Every code cell of a submission other than its (restored) check cells is the
student's. :func:`scan` parses them and reports, by cell:

- imports of course_lib's implementation of one of the lab's exercises (the
  object, or a module holding one: ``from course_lib.collectives.p2p import
  ring_shift``, ``import course_lib.fsdp.unit``), and imports of the grader's own
  modules;
- assignments to attributes of course_lib, torch, ``sys``, ``builtins`` or
  ``importlib`` (``checks.expect_close = ...``, ``torch.testing.assert_close =
  ...``), including through names bound to them by an import, ``setattr`` /
  ``delattr`` on them, and writes into their ``__dict__``; and anything kept on
  another imported module (``collections.kept = type(model)``: a warm rank keeps it
  for the next request);
- a pass line (``✓ Exercise N.M``) written in the student's code, or a call of
  ``checks.passed``;
- code or names built at run time (``exec``, ``eval``, ``compile``,
  ``__import__``, ``importlib.import_module`` of a computed name, ``getattr``
  with a computed name): the judge's reading of the source
  (:mod:`~course_lib.grading.source`) cannot follow them, so a person should;
- code that makes what runs differ from what the notebook says, or looks behind
  it (:mod:`.behind_text`): frames (``sys._getframe``, ``inspect.stack``),
  ``gc`` walks, ``sys.setprofile``/``settrace``, IPython's input transformers,
  AST transformers and custom exception handlers, ``__code__``/``__class__``/
  ``__globals__`` assigned, ``__reduce__`` defined, a frame reached through a
  traceback (``tb_frame``, ``f_back``), Python started in a
  subprocess, a course file's text read (``__file__``, ``inspect.getsource``), a
  function's insides read (``__globals__``, ``__code__``, ``__closure__``), code turned
  into bytes or rebuilt from them (``marshal``, ``pickle``, ``types.FunctionType``);
- code that reaches beneath the instruments a check reads (door 4): a private name
  of course_lib or torch (``comm._active``, ``torch._C``, ``_pop_mode``), or a
  thread of its own (a FLOP counter counts the thread it was entered on).

Whatever the lab itself contains is given, not the student's: a statement
found in the generated lab (its setup cell imports ``from course_lib import
collectives as reference``, for instance) is never flagged. A flag does not
change a grade by itself; it tells the instructor which notebooks to read.
"""
from __future__ import annotations

import ast
import importlib
import types

from course_lib.grading import ids
from course_lib.grading.behind_text import asked_for, behind_the_text, dotted as _dotted
from course_lib.grading.references import reference_modules, references

PASS_TEXTS = ids.PASS_TEXTS  # "✓ Exercise", "✓ Prediction"
RUN_TIME_CODE = {"exec", "eval", "compile", "builtins.exec", "builtins.eval", "builtins.compile",
                 "__import__", "builtins.__import__"}
# a call whose argument at this position names something: flagged when it is computed
RUN_TIME_NAMES = {"getattr": 1, "builtins.getattr": 1, "importlib.import_module": 0}
PROTECTED_ROOTS = ("course_lib", "torch", "sys", "builtins", "importlib")
GRADER_MODULES = ("course_lib.grading.integrity", "course_lib.grading.gradebook",
                  "course_lib.grading.submissions", "course_lib.grading.judge",
                  "course_lib.grading.sandbox", "course_lib.submission.collector",
                  "course_lib.submission.calls",
                  "course_lib.grading.requests", "course_lib.grading.source")


def python_source(source):
    """The cell as Python (IPython magics turned into calls), plus the bodies of cell
    magics (a ``%%torchrun`` cell's body runs on the ranks), each parseable or None."""
    from IPython.core.inputtransformer2 import TransformerManager

    try:
        code = TransformerManager().transform_cell(source)
    except Exception:  # noqa: BLE001 - a cell IPython cannot read does not run either
        return []
    sources = [code]
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "run_cell_magic" and len(node.args) == 3
                and isinstance(node.args[2], ast.Constant) and isinstance(node.args[2].value, str)):
            sources.append(node.args[2].value)
    return sources


def _trees(source):
    for code in python_source(source):
        try:
            yield ast.parse(code)
        except SyntaxError:
            continue


def _aliases(tree, into):
    """Names bound by the imports of ``tree``: {name: dotted path}."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    into[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    into[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if alias.name != "*":
                    into[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return into


def _protected(path):
    return path is not None and path.split(".")[0] in PROTECTED_ROOTS


class _Lab:
    """What the lab gives: its statements that would be flagged, and its references."""

    def __init__(self, lab_sources, exercises):
        self.refs = {}
        for ex in exercises:
            self.refs.update({id(obj): (name, ex) for obj, name in references(ex).items()})
        self.ref_modules = reference_modules(exercises)
        self.asked = asked_for(exercises)
        self.given, self.aliases = set(), {}
        for source in lab_sources:
            for tree in _trees(source):
                _aliases(tree, self.aliases)
                self.given |= {key for key, _ in _findings(tree, self, self.aliases)}

    def about(self, module, name=None):
        """Why importing ``module`` (or ``name`` from it) reaches a reference, or None."""
        if module in GRADER_MODULES:
            return "the grader's own module"
        if not module.startswith("course_lib"):
            return None
        try:
            obj = importlib.import_module(module)
            if name is not None:
                obj = getattr(obj, name) if hasattr(obj, name) else \
                    importlib.import_module(f"{module}.{name}")  # a submodule not loaded yet
        except (ImportError, AttributeError):
            return None
        if id(obj) in self.refs:
            ref, ex = self.refs[id(obj)]
            return f"course_lib's implementation of {ex}"
        if isinstance(obj, types.ModuleType):
            if obj.__name__ in GRADER_MODULES:
                return "the grader's own module"
            held = sorted({ex for value in vars(obj).values()
                           for ex in [self.refs.get(id(value), (None, None))[1]] if ex})
            if held or obj.__name__ in self.ref_modules:
                return "a module holding course_lib's implementation of " + \
                    (", ".join(held) if held else "an exercise of this lab")
        return None


def _findings(tree, lab, aliases):
    """(key, message) for each suspicious node; the key ignores positions."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                why = lab.about(alias.name)
                if why:
                    yield ast.dump(alias), f"imports {alias.name} ({why})"
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                why = lab.about(node.module, None if alias.name == "*" else alias.name)
                if why:
                    yield (f"{node.module}:{ast.dump(alias)}",
                           f"imports {alias.name} from {node.module} ({why})")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    path = None
                    if isinstance(sub, ast.Attribute):
                        path = _dotted(sub, aliases)
                    elif isinstance(sub, ast.Subscript) and (
                            isinstance(sub.value, ast.Attribute) and sub.value.attr == "__dict__"
                            or isinstance(sub.value, ast.Call)):
                        path = _dotted(getattr(sub.value, "value", sub.value), aliases)
                    if _protected(path):
                        verb = "deletes" if isinstance(node, ast.Delete) else "assigns to"
                        yield ast.dump(node), f"{verb} {path}"
                        break
                    if path is not None and sub is target and isinstance(node, ast.Assign) \
                            and isinstance(target, ast.Attribute):
                        # a module outlives the request: what is kept there reaches later ones
                        yield ast.dump(node), f"keeps something on a module ({path})"
                        break
        elif isinstance(node, ast.Call):
            func = _dotted(node.func, aliases) or getattr(node.func, "id", None)
            if func in ("setattr", "delattr", "builtins.setattr", "builtins.delattr") and node.args:
                path = _dotted(node.args[0], aliases)
                if _protected(path):
                    yield ast.dump(node), f"calls {func.split('.')[-1]} on {path}"
            elif func == "course_lib.grading.checks.passed":
                yield ast.dump(node), "calls checks.passed itself"
            elif func in RUN_TIME_CODE or (
                    func in RUN_TIME_NAMES and len(node.args) > RUN_TIME_NAMES[func]
                    and not isinstance(node.args[RUN_TIME_NAMES[func]], ast.Constant)):
                yield ast.dump(node), f"builds code or names at run time ({func.split('.')[-1]})"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and any(text in node.value for text in PASS_TEXTS):
            yield ast.dump(node), f"writes a pass line ({node.value.strip()[:60]!r})"
        yield from behind_the_text(node, aliases, lab.asked)


def scan(student_cells, lab_sources, exercises):
    """Flags for ``student_cells`` ([(label, source)], e.g. ("cell 12", "...")), given
    the generated lab's code cells ``lab_sources`` and its ``exercises`` ids."""
    lab = _Lab(lab_sources, exercises)
    aliases = dict(lab.aliases)
    trees = [(label, list(_trees(source))) for label, source in student_cells]
    for _, parsed in trees:
        for tree in parsed:
            _aliases(tree, aliases)
    flags = []
    for label, parsed in trees:
        for tree in parsed:
            for key, message in _findings(tree, lab, aliases):
                line = f"{label}: {message}"
                if key not in lab.given and line not in flags:
                    flags.append(line)
    return flags
