"""Code that must also run on GPU ranks, read for what a CPU run cannot show.

A warm NCCL rank sets its default device to its GPU. From then on a random
factory given a CPU generator, ``torch.randn(n, generator=g)``, creates its
tensor on the GPU and raises "Expected a 'cuda' device type for generator but
found 'cpu'". Every such call in course_lib and in the notebooks must name the
device it draws on (``device="cpu"``, then move the result), and an in-place
draw (``t.normal_(generator=g)``) is not used at all: its tensor's device is not
written where the call is.
"""
import ast
from pathlib import Path

import nbformat

from course_lib.grading.integrity import python_source

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = {"randn", "rand", "randint", "randperm", "normal", "poisson", "rand_like",
             "randn_like", "randint_like"}
IN_PLACE = {"normal_", "uniform_", "random_", "exponential_", "geometric_", "cauchy_",
            "log_normal_", "bernoulli_"}


def sources():
    for path in sorted((ROOT / "course_lib").rglob("*.py")):
        yield str(path.relative_to(ROOT)), path.read_text()
    for folder in ("solutions", "labs"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            for index, cell in enumerate(nbformat.read(path, 4).cells):
                if cell.cell_type == "code":
                    for code in python_source(cell.source):
                        yield f"{folder}/{path.name}, cell {index}", code


def draws_without_a_device(code):
    """(line, call) of every draw with a generator and no device."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", None))
        keywords = {k.arg for k in node.keywords}
        if "generator" not in keywords:
            continue
        if (name in FACTORIES and "device" not in keywords and not name.endswith("_like")) \
                or name in IN_PLACE:
            found.append((node.lineno, ast.unparse(node)[:80]))
    return found


def test_the_rule_finds_what_it_is_for():
    assert draws_without_a_device("x = torch.randn(3, generator=g)") == [
        (1, "torch.randn(3, generator=g)")]
    assert draws_without_a_device("w.normal_(generator=g)") == [(1, "w.normal_(generator=g)")]
    assert draws_without_a_device("torch.randint(0, 9, (2,), generator=g, device='cpu')\n"
                                  "torch.randn(3)\ntorch.randn_like(x, generator=g)") == []


def test_every_draw_with_a_generator_names_its_device():
    found = [(where, line, call) for where, code in sources()
             for line, call in draws_without_a_device(code)]
    assert found == []
