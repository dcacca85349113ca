"""Door 6 of the integrity scan (:mod:`.integrity`): code that makes what runs differ
from the notebook's text, or looks behind it (frames, ``gc``, hooks, swapped code, a
function's insides, course files), and code that reaches beneath the instruments a
check reads (a private name of course_lib or torch, a thread of its own). Each is
flagged for a person to read; none changes a grade by itself.
"""
from __future__ import annotations

import ast

# calls that look behind the notebook's text or change what runs: flagged for a person
BEHIND_THE_TEXT = {
    "sys._getframe": "inspects frames", "sys._current_frames": "inspects frames",
    "inspect.currentframe": "inspects frames", "inspect.stack": "inspects frames",
    "inspect.trace": "inspects frames", "inspect.getouterframes": "inspects frames",
    "inspect.getsource": "reads source code", "inspect.getsourcefile": "reads source code",
    "inspect.getfile": "reads source code",
    # what a shipped function was built with: its defaults, the globals its code names
    "inspect.signature": "reads a function's insides",
    "inspect.getclosurevars": "reads a function's insides",
    "inspect.getfullargspec": "reads a function's insides",
    "gc.get_objects": "walks gc", "gc.get_referrers": "walks gc", "gc.get_referents": "walks gc",
    "sys.settrace": "hooks the tracer", "sys.setprofile": "hooks the profiler",
    "threading.settrace": "hooks the tracer", "threading.setprofile": "hooks the profiler",
    "sys.addaudithook": "hooks the interpreter", "sys.monitoring.register_callback":
    "hooks the interpreter", "sys.monitoring.use_tool_id": "hooks the interpreter",
    "subprocess.run": "starts a process", "subprocess.Popen": "starts a process",
    "subprocess.call": "starts a process", "subprocess.check_call": "starts a process",
    "subprocess.check_output": "starts a process", "os.system": "starts a process",
    "os.popen": "starts a process", "os.execv": "starts a process",
    "os.execvp": "starts a process", "os.spawnv": "starts a process",
    "multiprocessing.Process": "starts a process", "ctypes.pythonapi": "reaches into CPython",
    # the instruments a check reads (a FLOP counter, a log of operations) are per thread
    "threading.Thread": "runs code in another thread",
    "concurrent.futures.ThreadPoolExecutor": "runs code in another thread",
    # code carried from one process or request to another, around what the judge sends
    "marshal.loads": "rebuilds code from bytes", "marshal.load": "rebuilds code from bytes",
    "marshal.dumps": "turns code into bytes", "marshal.dump": "turns code into bytes",
    "types.FunctionType": "builds a function from a code object",
    "types.CodeType": "builds a code object", "cloudpickle.dumps": "turns code into bytes",
    "cloudpickle.loads": "rebuilds code from bytes", "pickle.loads": "rebuilds objects from bytes",
    "pickle.load": "rebuilds objects from bytes", "dill.dumps": "turns code into bytes",
    "dill.loads": "rebuilds code from bytes",
    # the course's own pickler sends code by value (what the launcher uses)
    "course_lib.runtime.pickling.dumps": "turns code into bytes",
    "course_lib.runtime.pickling.Pickler": "turns code into bytes",
    # a module named by a string: the judge's reading of the source follows names only
    "importlib.import_module": "imports a module named by a string",
    "importlib.__import__": "imports a module named by a string",
}
# calls an exercise asks the student to make: not flagged in that exercise's lab
ASKED_FOR = {
    # an asynchronous save: the writing on a thread of its own (the check watches that
    # thread's collectives itself)
    "Exercise 8.6": ("threading.Thread", "concurrent.futures.ThreadPoolExecutor"),
}
# loaders that unpickle anything (code by value included) when told to
UNPICKLING = {"torch.load": ("weights_only", False), "torch.serialization.load":
              ("weights_only", False), "numpy.load": ("allow_pickle", True)}
# IPython's hooks on what a cell runs or what its error shows
IPYTHON_HOOKS = {"input_transformers_cleanup", "input_transformers_post", "ast_transformers",
                 "set_custom_exc", "register_magic_function", "events"}
# attributes whose assignment swaps what an object is or what a function runs
SWAPPED = {"__code__", "__class__", "__globals__", "__defaults__", "__kwdefaults__",
           "__closure__", "__bases__", "__dict__"}
# attributes whose reading takes what a function or class holds, not what it does (the
# library's code the judge ships runs beside the student's: its globals are there)
INSIDES = {"__globals__", "__code__", "__closure__", "__wrapped__", "__subclasses__",
           "__defaults__", "__kwdefaults__"}
# a frame reached without inspect or sys (through an exception's traceback, a generator)
FRAMES = {"tb_frame", "f_back", "f_globals", "f_locals", "f_builtins", "gi_frame", "cr_frame",
          "ag_frame"}
# methods whose definition changes how an object travels or is rebuilt
REBUILT = {"__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__getnewargs__",
           "__getnewargs_ex__"}

def dotted(node, aliases):
    """``checks.expect_close`` -> "course_lib.grading.checks.expect_close" (None when
    the chain does not start with a name)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" \
            and node.args:
        return dotted(node.args[0], aliases)
    if not isinstance(node, ast.Name):
        return None
    root = "builtins" if node.id == "__builtins__" else aliases.get(node.id)
    return ".".join([root, *reversed(parts)]) if root else None


def asked_for(exercises):
    """The calls :data:`ASKED_FOR` lets a lab of ``exercises`` make."""
    return {func for ex in exercises for func in ASKED_FOR.get(ex, ())}


def behind_the_text(node, aliases, asked=frozenset()):
    """Door 6: what makes the code that runs differ from the notebook's text, or reads
    what the grader keeps (frames, gc, hooks, swapped code, course files); ``asked``:
    calls the lab's exercises ask for (:func:`asked_for`)."""
    if isinstance(node, ast.Call):
        func = dotted(node.func, aliases)
        if func in asked:
            pass
        elif func in BEHIND_THE_TEXT:
            yield ast.dump(node), f"{BEHIND_THE_TEXT[func]} ({func})"
        elif func and func.split(".")[0] == "ctypes":
            yield ast.dump(node), f"reaches into CPython ({func})"
        elif func in UNPICKLING and any(
                k.arg == UNPICKLING[func][0] and isinstance(k.value, ast.Constant)
                and k.value.value == UNPICKLING[func][1] for k in node.keywords):
            yield ast.dump(node), f"rebuilds objects from bytes ({func}, " \
                                  f"{UNPICKLING[func][0]}={UNPICKLING[func][1]})"
    paths = []
    if isinstance(node, ast.Attribute):
        paths = [dotted(node, aliases) or ""]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        paths = [f"{node.module}.{alias.name}" for alias in node.names]
    elif isinstance(node, ast.Import):
        paths = [alias.name for alias in node.names]
    for path in paths:
        parts = path.split(".")
        private = next((i for i, part in enumerate(parts) if _private(part)), None)
        if parts[0] in ("course_lib", "torch") and private is not None:
            reached = ".".join(parts[:private + 1])  # one line however deep the path goes
            yield f"private:{reached}", f"reaches beneath the instruments ({reached})"
    if isinstance(node, ast.Attribute) and node.attr in IPYTHON_HOOKS:
        yield ast.dump(node), f"hooks IPython ({node.attr})"
    elif isinstance(node, ast.Attribute) and node.attr in INSIDES \
            and isinstance(node.ctx, ast.Load):
        yield ast.dump(node), f"reads a function's insides ({node.attr})"
    elif isinstance(node, ast.Attribute) and node.attr in FRAMES:
        yield ast.dump(node), f"inspects frames ({node.attr})"
    elif isinstance(node, ast.Attribute) and node.attr == "modules" \
            and dotted(node, aliases) == "sys.modules":
        yield ast.dump(node), "reaches a module through sys.modules"
    elif isinstance(node, ast.Attribute) and node.attr == "__file__":
        path = dotted(node.value, aliases) or ""
        if path.split(".")[0] in ("course_lib", "torch"):
            yield ast.dump(node), f"reads a course file's path ({path}.__file__)"
    elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr in SWAPPED:
                yield ast.dump(node), f"swaps {target.attr} (what runs is not what the text says)"
    elif isinstance(node, ast.FunctionDef) and node.name in REBUILT:
        yield ast.dump(node), f"defines {node.name} (how an object travels)"


def _private(name):
    """``_active``, ``_C``: a name a module keeps to itself (not a dunder)."""
    return name.startswith("_") and not name.endswith("__")
