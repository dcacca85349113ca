"""Bytes per training step: DataParallel's GPU 0 against each DDP rank (Lab 02).

With K devices, P bytes of parameters, B bytes of input batch and O bytes of
output per step:

- DP (one process; GPU 0 is the hub) moves through GPU 0: the batch scattered
  ((K-1)/K B out), the weights replicated ((K-1) P out), the outputs gathered
  ((K-1)/K O in), the outputs' gradients scattered back in backward ((K-1)/K O
  out) and the gradients reduced ((K-1) P in): about 2(K-1)P, growing with K,
  all through one device.
- DDP (one process per device, ring all-reduce) sends 2(K-1)/K P per rank and
  receives as much, whatever K: the load is spread evenly over all links.

Both are measured, not only computed: :func:`measured_dp_step` counts rank 0's
bytes in one step of :func:`course_lib.ddp.dp.dp_step` (DataParallel played on
ranks) and :func:`measured_ddp_step` what our DDP with course_lib's ring
all-reduce sends in one step (``comm.counting()``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import comm


def dp_bytes_through_device0(param_bytes, batch_bytes, output_bytes, k, buffer_bytes=0):
    """{"sent": ..., "received": ...} bytes of GPU 0 in one DataParallel step
    (the batch's rows divisible by ``k``). Buffers (BatchNorm's statistics) are
    replicated with the weights but have no gradient to reduce."""
    share = (k - 1) / k
    return {"sent": share * batch_bytes + (k - 1) * (param_bytes + buffer_bytes)
                    + share * output_bytes,
            "received": share * output_bytes + (k - 1) * param_bytes}


def ddp_bytes_per_rank(param_bytes, k):
    """{"sent": ..., "received": ...} bytes of each rank's ring all-reduce."""
    moved = 2 * (k - 1) / k * param_bytes
    return {"sent": moved, "received": moved}


def measured_ddp_step(model, x, y, bucket_cap_mb=None):
    """One step of our DDP with course_lib's ring all-reduce on ``model``, counted:
    {"sent": bytes, "received": bytes, "param_bytes": P} on this rank."""
    from course_lib.ddp.bucketed import DDP

    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, all_reduce="ring", broadcast_buffers=False)
    F.mse_loss(ddp(x), y).backward()  # the first step fixes the bucket order
    for p in model.parameters():
        p.grad = None
    with comm.counting() as stats:
        F.mse_loss(ddp(x), y).backward()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    return {"sent": stats.sent_bytes, "received": stats.recv_bytes, "param_bytes": param_bytes}


def measured_dp_step(model, x, y, loss_fn=F.mse_loss):
    """One DataParallel step (:func:`course_lib.ddp.dp.dp_step`) counted on this
    rank: {"sent", "received", "phases": {phase: {"sent", "received"}}, and the
    sizes the formula takes: "param_bytes", "buffer_bytes", "batch_bytes",
    "output_bytes"}. Rank 0 is DataParallel's device 0."""
    from course_lib.ddp.dp import dp_step

    phases = {}
    dp_step(model, x, y, loss_fn, phases=phases)  # every message it sends is in a phase
    with_grad = [p for p in model.parameters() if p.requires_grad]
    training = model.training
    with torch.no_grad():  # one row, in eval mode (BatchNorm), gives the output's row size
        out_rows = model.eval()(x[:1])
    model.train(training)
    dist.barrier()
    return {"sent": sum(v["sent"] for v in phases.values()),
            "received": sum(v["received"] for v in phases.values()), "phases": phases,
            "param_bytes": sum(p.numel() * p.element_size() for p in with_grad),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
            "batch_bytes": x.numel() * x.element_size(),
            "output_bytes": out_rows.numel() * out_rows.element_size() * x.shape[0]}


def traffic_table(param_bytes, batch_bytes, output_bytes, ks=(2, 4, 8, 16)):
    """Rows (K, DP GPU 0 sent+received, DDP per rank sent+received), in bytes."""
    rows = []
    for k in ks:
        dp = dp_bytes_through_device0(param_bytes, batch_bytes, output_bytes, k)
        ddp = ddp_bytes_per_rank(param_bytes, k)
        rows.append((k, dp["sent"] + dp["received"], ddp["sent"] + ddp["received"]))
    return rows


__all__ = ["dp_bytes_through_device0", "ddp_bytes_per_rank", "measured_dp_step",
           "measured_ddp_step", "traffic_table"]
