"""The judge's reading of the student's source: stubs and course_lib's implementations,
found in the text and its bytecode without running a line of it."""
import pytest

from course_lib.grading.source import Source

SETUP = "import torch\nfrom course_lib import comm\nfrom course_lib.collectives import p2p"
OWN = '''def ring_shift(x):
    out = torch.empty_like(x)
    comm.exchange(sends=[(x, 1)], recvs=[(out, 1)])
    return out'''


def read(*cells):
    return Source(list(enumerate([SETUP, *cells])))


@pytest.mark.parametrize("cells,found", [
    (["def ring_shift(x):\n    return p2p.ring_shift(x)"],
     "ring_shift uses course_lib.collectives.p2p.ring_shift"),
    (["def ring_shift(x, _impl=p2p.ring_shift):\n    return _impl(x)"],
     "ring_shift uses course_lib.collectives.p2p.ring_shift"),
    (["class Shift:\n    def __call__(self, x):\n        return p2p.ring_shift(x)\n\n"
      "ring_shift = Shift()"], "ring_shift uses course_lib.collectives.p2p.ring_shift"),
    (["import functools\nring_shift = functools.partial(p2p.ring_shift)"],
     "ring_shift uses course_lib.collectives.p2p.ring_shift"),
    (["def helper(x):\n    return p2p.ring_shift(x)", "def ring_shift(x):\n    return helper(x)"],
     "ring_shift -> helper uses course_lib.collectives.p2p.ring_shift"),
    (["def ring_shift(x):\n    from course_lib.collectives.p2p import ring_shift as r\n"
      "    return r(x)"], "ring_shift imports course_lib.collectives.p2p.ring_shift"),
    (["def ring_shift(x):\n    return getattr(p2p, 'ring_shift')(x)"],
     "ring_shift reaches by name course_lib.collectives.p2p.ring_shift"),
    (["from course_lib.collectives.p2p import ring_shift"],
     "ring_shift imports course_lib.collectives.p2p.ring_shift"),
    (["%%torchrun -n 2\nring_shift = p2p.ring_shift"],
     "ring_shift uses course_lib.collectives.p2p.ring_shift"),
], ids=["call", "default", "wrapper", "partial", "helper", "import", "getattr", "rebound",
        "magic"])
def test_the_library_s_implementation_is_found_however_it_is_handed_over(cells, found):
    source = read(*cells)
    lines = source.references("Exercise 0.3", ["ring_shift"], before=len(cells) + 1)
    assert lines and lines[0].startswith(found), lines


def test_own_code_and_the_lab_s_given_imports_are_not_reported():
    source = read(OWN)
    assert source.references("Exercise 0.3", ["ring_shift"], before=2) == []
    # another exercise's reference is not this one's business
    other = read("def ring_shift(x):\n    return p2p.token_ring(x)")
    assert other.references("Exercise 0.3", ["ring_shift"], before=2) == []
    # only definitions before the check count: a later cell does not change what ran
    later = read(OWN, "def ring_shift(x):\n    return p2p.ring_shift(x)")
    assert later.references("Exercise 0.3", ["ring_shift"], before=2) == []
    assert later.references("Exercise 0.3", ["ring_shift"], before=3) != []


def test_stubs_are_read_from_the_last_definition_before_the_check():
    stub = 'def ring_shift(x):\n    raise NotImplementedError("Exercise 0.3: ring shift")'
    scaffold = ('class Hooks:\n    def pack(self, t):\n        return t\n\n'
                '    def unpack(self, t):\n        raise NotImplementedError("Exercise 3.7: x")')
    source = read(stub, OWN, scaffold)
    assert source.stubs(["ring_shift"], before=2) == ["ring_shift"]
    assert source.stubs(["ring_shift"], before=3) == []
    assert source.stubs(["Hooks"], before=4) == ["Hooks"]
    assert source.stubs(["never_defined"], before=4) == []


def test_a_cell_that_does_not_parse_is_skipped_not_fatal():
    source = read("def ring_shift(x:\n", OWN)
    assert source.references("Exercise 0.3", ["ring_shift"], before=3) == []
