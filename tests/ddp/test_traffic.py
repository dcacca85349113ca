"""DP versus DDP bytes: formulas by hand, and the ring DDP's counted traffic."""
import pytest
import torch

from conftest import ship_by_value
from course_lib import run
from course_lib.ddp import traffic
from course_lib.models import deep_mlp

ship_by_value(__name__)


def test_dp_hub_grows_with_k_while_ddp_per_rank_stays_bounded():
    p, b, o = 1000, 80, 40
    assert traffic.dp_bytes_through_device0(p, b, o, 4) == {"sent": 60 + 3000, "received": 30 + 3000}
    assert traffic.ddp_bytes_per_rank(p, 4) == {"sent": 1500, "received": 1500}
    rows = traffic.traffic_table(p, b, o, ks=(2, 16))
    assert rows[1][1] > 7 * rows[0][1]  # DP's hub: ~ (K-1)
    assert rows[1][2] < 2 * rows[0][2]  # DDP: 2(K-1)/K < 2


def counted_step():
    torch.manual_seed(0)
    model = deep_mlp(30, 2, inputs=7, outputs=5)  # sizes that do not divide by 3
    x, y = torch.randn(4, 7), torch.randn(4, 5)
    return traffic.measured_ddp_step(model, x, y, bucket_cap_mb=0.001)


@pytest.mark.parametrize("k", [2, 3])
def test_ring_ddp_sends_what_the_formula_says(k):
    for out in run(counted_step, nproc=k, timeout=120):
        want = traffic.ddp_bytes_per_rank(out["param_bytes"], k)
        # chunks of a bucket that does not divide by K differ by one element each
        assert abs(out["sent"] - want["sent"]) <= 2 * 4 * 16
        assert abs(out["received"] - want["received"]) <= 2 * 4 * 16
