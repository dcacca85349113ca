"""The ids that thread through a lab: ``Exercise 2.3`` (code the student writes) and
``Prediction 2.1`` (a number the student predicts, as a function of the setting,
before a cell measures it). Each is a heading in the notebook, a stub, a check that
prints ``✓ <id> passed`` and a column of the gradebook; both kinds are graded alike.
"""
import re

KINDS = ("Exercise", "Prediction")
_KIND = "|".join(KINDS)
# a markdown heading that opens an item: group 1 the id, 2 its number, 3 its title
HEADING = re.compile(rf"^#+\s.*?((?:{_KIND})\s+(\d+\.\d+))\s*[:.\-–—]?\s*(.*)$", re.M)
# an id at the start of a check's message ("Exercise 2.3: rank 1 ...")
IN_MESSAGE = re.compile(rf"^\s*((?:{_KIND}) \d+(?:\.\d+)*)\b")
PASS_TEXTS = tuple(f"✓ {kind}" for kind in KINDS)
_LOOSE = re.compile(rf"^\s*({_KIND})?\s*(\d+(?:\.\d+)*)\s*$", re.IGNORECASE)


def normalize(item):
    """``"Exercise 2.3"`` for "Exercise 2.3", "exercise  2.3" and "2.3" (a bare number is
    an exercise); ``"Prediction 2.1"`` for "prediction 2.1"; anything else stripped."""
    found = _LOOSE.match(str(item))
    if not found:
        return str(item).strip()
    kind = (found.group(1) or "Exercise").capitalize()
    return f"{kind} {found.group(2)}"


def sort_key(item):
    """Gradebook order: by lab, then a lab's exercises, then its predictions, by number."""
    kind = next((i for i, k in enumerate(KINDS) if str(item).startswith(k)), len(KINDS))
    lab, *rest = [int(n) for n in re.findall(r"\d+", str(item))] or [0]
    return (lab, kind, *rest)
