"""A mini lab for the gradebook's tests: two exercises on ranks (Lab 00's token ring and
ring shift) and one in the student's own process (Lab 03's shard bounds), with the
real checks; and the submissions a class hands in, honest and not."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[2]

TOKEN_RING = '''def token_ring(token):
    rank, world = dist.get_rank(), dist.get_world_size()
    ### BEGIN SOLUTION
    right, left = (rank + 1) % world, (rank - 1) % world
    if rank == 0:
        comm.send(token, right)
        back = torch.empty_like(token)
        comm.recv(back, left)
        return back
    received = torch.empty_like(token)
    comm.recv(received, left)
    comm.send(received + rank, right)
    return received + rank
    ### END SOLUTION'''
RING_SHIFT = '''def ring_shift(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    ### BEGIN SOLUTION
    out = torch.empty_like(x)
    comm.exchange(sends=[(x, (rank + 1) % world)], recvs=[(out, (rank - 1) % world)])
    return out
    ### END SOLUTION'''
SHARD_BOUNDS = '''def shard_bounds(numel, rank, world):
    ### BEGIN SOLUTION
    padded = max(-(-numel // world) * world, world)
    size = padded // world
    return rank * size, (rank + 1) * size, padded
    ### END SOLUTION'''
HIDDEN = ("\n### BEGIN HIDDEN TESTS\n"
          "lab00.check_ring_shift(ring_shift, world_sizes=(3,), timeout=10)\n"
          "### END HIDDEN TESTS")
SETUP = '''import os
import time

import torch
import torch.distributed as dist

from course_lib import comm, run
from course_lib.grading import checks, lab00, lab03

os.makedirs(OUTPUT_DIR, exist_ok=True)
with open(os.path.join(OUTPUT_DIR, "written.txt"), "w") as f:
    f.write("a notebook writes here")'''
DEMO = '''with open(os.path.join(OUTPUT_DIR, "demo.txt"), "w") as f:
    f.write("the demo ran")
print("a demo: only a full run shows it")'''
# cells of the mini lab, by name, so that submissions can say which cell they change
MINI = ["title", "params", "setup", "h02", "token_ring", "check02", "h03", "ring_shift",
        "check03", "h33", "shard_bounds", "check33", "demo"]
CELL = {name: i for i, name in enumerate(MINI)}


def mini_solution(hidden=False):
    """The mini lab's solution notebook (``hidden``: a hidden test at world size 3)."""
    cells = [new_markdown_cell("# A mini lab: two exercises on ranks, one in the process"),
             new_code_cell('NPROC: int = 2\nBACKEND: str = "auto"\nQUICK: bool = True\n'
                           'OUTPUT_DIR: str = "../runs/latest"'),
             new_code_cell(SETUP),
             new_markdown_cell("### Exercise 0.2: token ring"), new_code_cell(TOKEN_RING),
             new_code_cell("lab00.check_token_ring(token_ring, world_sizes=(2,))"),
             new_markdown_cell("### Exercise 0.3: ring shift"), new_code_cell(RING_SHIFT),
             new_code_cell("lab00.check_ring_shift(ring_shift, world_sizes=(2,), timeout=10)"
                           + (HIDDEN if hidden else "")),
             new_markdown_cell("### Exercise 3.3: shard bounds"), new_code_cell(SHARD_BOUNDS),
             new_code_cell("lab03.check_shard_bounds(shard_bounds, trials=20)"),
             new_code_cell(DEMO)]
    cells[CELL["params"]].metadata["tags"] = ["parameters"]
    cells[CELL["setup"]].metadata["tags"] = ["setup"]
    for name in ("check02", "check03", "check33"):
        cells[CELL[name]].metadata["tags"] = ["check"]
    for index, cell in enumerate(cells):
        cell.id = f"mini-{index:02d}"
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def edited(nb, after=None, **sources):
    """A copy of ``nb`` with cells replaced ({name: source}) and new cells inserted
    ({name of the cell they follow: source}, in ``after``)."""
    nb = nbformat.from_dict(nbformat.reads(nbformat.writes(nb), as_version=4))
    for name, source in sources.items():
        nb.cells[CELL[name]].source = source
    for name, source in sorted((after or {}).items(), key=lambda kv: -CELL[kv[0]]):
        nb.cells.insert(CELL[name] + 1, new_code_cell(source))
    return nb


def put(path, nb):
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def write_course(root, hidden=False):
    """solutions/ with the mini lab, and its students' lab; returns (solutions, lab)."""
    from course_lib.grading.labgen import make_lab

    solutions = root / "solutions"
    solution = mini_solution(hidden)
    put(solutions / "00_mini.ipynb", solution)
    return solutions, make_lab(solution)
