"""DP versus DDP bytes: formulas by hand, DataParallel played on ranks (counted,
and its gradients against one process), and the ring DDP's counted traffic."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conftest import ship_by_value
from course_lib import run
from course_lib.ddp import dp, traffic
from course_lib.models import deep_mlp

ship_by_value(__name__)


def test_dp_hub_grows_with_k_while_ddp_per_rank_stays_bounded():
    p, b, o = 1000, 80, 40
    # sent: 3/4 of the batch, 3 copies of the weights, 3/4 of the outputs' gradients;
    # received: 3/4 of the outputs, 3 replicas' gradients
    assert traffic.dp_bytes_through_device0(p, b, o, 4) == {"sent": 60 + 3000 + 30,
                                                            "received": 30 + 3000}
    assert traffic.dp_bytes_through_device0(p, b, o, 4, buffer_bytes=10)["sent"] == 60 + 3030 + 30
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


def _dp_model(kind):
    torch.manual_seed(0)
    if kind == "batchnorm":  # buffers are replicated too, but have no gradient
        return nn.Sequential(nn.Linear(7, 30), nn.BatchNorm1d(30), nn.ReLU(), nn.Linear(30, 5))
    return deep_mlp(30, 2, inputs=7, outputs=5)


def counted_dp_step(kind, rows):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows, 7, generator=gen), torch.randn(rows, 5, generator=gen)
    return traffic.measured_dp_step(_dp_model(kind), x, y)


@pytest.mark.parametrize("kind", ["mlp", "batchnorm"])
@pytest.mark.parametrize("k", [2, 3])
def test_dp_step_moves_what_the_formula_says(k, kind):
    rows = 12  # divisible by 2 and 3: the formula's (K-1)/K is exact
    outs = run(counted_dp_step, kind, rows, nproc=k, timeout=120)
    hub = outs[0]
    p, bufs, b, o = (hub[key] for key in ("param_bytes", "buffer_bytes", "batch_bytes",
                                          "output_bytes"))
    assert (bufs > 0) == (kind == "batchnorm")
    want = traffic.dp_bytes_through_device0(p, b, o, k, buffer_bytes=bufs)
    assert hub["sent"] == round(want["sent"]) and hub["received"] == round(want["received"])
    share = (k - 1) / k
    assert hub["phases"] == {
        "scatter": {"sent": round(share * b), "received": 0},
        "replicate": {"sent": (k - 1) * (p + bufs), "received": 0},
        "gather": {"sent": 0, "received": round(share * o)},
        "scatter grad": {"sent": round(share * o), "received": 0},
        "reduce grads": {"sent": 0, "received": (k - 1) * p}}
    for out in outs[1:]:  # a replica: its slice, the weights and its outputs' gradient in
        assert out["received"] == b // k + p + bufs + o // k
        assert out["sent"] == o // k + p  # its outputs and its gradients out


def dp_training(rows, steps=3):
    """SGD steps of DataParallel on ranks. Only rank 0's data and weights count: the
    others start from other weights and hold zeros where rank 0 holds the batch."""
    rank = dist.get_rank()
    model = deep_mlp(16, 2, inputs=6, outputs=3, seed=0 if rank == 0 else 50 + rank)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(rows, 6, generator=gen), torch.randn(rows, 3, generator=gen)
    if rank != 0:
        x, y = torch.zeros_like(x), torch.zeros_like(y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, first_grads, phases = [], None, {}
    for _ in range(steps):
        opt.zero_grad()
        loss = dp.dp_step(model, x, y, phases=phases)
        if rank == 0:
            losses.append(loss.item())
            first_grads = first_grads or [p.grad.clone() for p in model.parameters()]
            opt.step()
    return losses, first_grads, [p.detach().clone() for p in model.parameters()], phases


@pytest.mark.parametrize("rows", [10, 2])
def test_dp_step_equals_one_process_on_the_whole_batch(rows):
    # 10 rows on 3 ranks: slices of 4, 4 and 2; 2 rows: slices of 1 and 1, rank 2 idle
    outs = run(dp_training, rows, nproc=3, timeout=120)
    model = deep_mlp(16, 2, inputs=6, outputs=3, seed=0)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(rows, 6, generator=gen), torch.randn(rows, 3, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, first_grads = [], None
    for _ in range(3):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        first_grads = first_grads or [p.grad.clone() for p in model.parameters()]
        opt.step()
    got_losses, got_grads, got_params, _ = outs[0]
    assert got_losses == pytest.approx(losses, rel=1e-5)
    for got, want in zip(got_grads + got_params, first_grads + list(model.parameters())):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    idle = outs[2][3]
    assert (sum(v["sent"] + v["received"] for v in idle.values()) == 0) == (rows == 2)


def mismatched_rows():
    try:
        dp.dp_step(deep_mlp(8, 1, inputs=4, outputs=2), torch.randn(6, 4), torch.randn(5, 2))
    except ValueError as exc:
        return str(exc)
    return None


def test_dp_step_rejects_a_batch_whose_targets_do_not_match():
    for message in run(mismatched_rows, nproc=2, timeout=60):
        assert message and "as many rows" in message
