"""The runtime floor's design, read from its imports: the launcher asks the pool, the pool
keeps jobs, a job owns its life and uses the pieces below it; nothing calls back up."""
import ast
from pathlib import Path

import course_lib.runtime

RUNTIME = Path(course_lib.runtime.__file__).parent

# the notebook's side, top down: a module may import only modules of later rows
NOTEBOOK_SIDE = [
    {"__main__", "magic"},
    {"launcher"},
    {"warm"},
    {"job"},
    {"command", "output", "results", "failures"},
    {"hangs"},
    {"stacks"},
    {"dumps", "procs", "folders", "nccl_rules", "shipped", "pickling"},
    {"backend"},
]


def runtime_imports(path):
    """The runtime modules ``path`` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("course_lib.runtime."):
                found.add(node.module.split(".")[2])
            elif node.module == "course_lib.runtime":
                found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names
                      if a.name.startswith("course_lib.runtime.")}
    return found


def graph():
    return {p.stem: runtime_imports(p) for p in RUNTIME.glob("*.py") if p.stem != "__init__"}


def test_the_notebook_side_imports_only_downwards():
    imports = graph()
    for row, modules in enumerate(NOTEBOOK_SIDE):
        below = set().union(*NOTEBOOK_SIDE[row + 1:])
        for module in modules:
            assert imports[module] <= below, (module, imports[module] - below)


def test_no_module_of_the_floor_imports_one_that_imports_it():
    imports = graph()

    def reaches(start):
        seen, todo = set(), [start]
        while todo:
            for dep in imports.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    cycles = [m for m in imports if m in reaches(m)]
    assert not cycles, cycles


def test_a_jobs_life_is_in_one_file_and_only_the_pool_and_the_launcher_start_jobs():
    job = (RUNTIME / "job.py").read_text()
    for step in ("def __init__", "def call", "def wait", "def _records_error", "def stacks",
                 "def end"):
        assert step in job, step
    starters = {p.stem for p in RUNTIME.glob("*.py") if "Job(" in p.read_text()} - {"job"}
    assert starters == {"warm", "launcher"}, starters
    # and the process layer knows processes only: no folder, no job, no failure
    procs = (RUNTIME / "procs.py").read_text()
    assert graph()["procs"] == set() and "rmtree" not in procs and "glob(" not in procs


def test_each_file_of_the_floor_stays_about_300_lines():
    long = {p.name: n for p in RUNTIME.glob("*.py")
            if (n := len(p.read_text().splitlines())) > 320}
    assert not long, long
