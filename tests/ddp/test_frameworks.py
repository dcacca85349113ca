"""A real Lightning Trainer (strategy="ddp") inside run(), against our DDP."""
import pytest

from course_lib import run
from course_lib.ddp import frameworks


def test_lightning_ddp_and_ours_give_the_same_losses():
    theirs = run(frameworks.lightning_losses, steps=4, nproc=2, timeout=180)
    ours = run(frameworks.our_losses, steps=4, nproc=2, timeout=180)
    assert theirs[0] == theirs[1] and len(theirs[0]) == 4
    assert theirs[0][-1] < theirs[0][0]  # it trains
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5)
