"""The same training run with PyTorch Lightning's DDP strategy and with ours (Lab 02).

Lightning (2.6) runs one process per device with ``strategy="ddp"``. Started
under torchrun, it finds the environment torchrun set (``TorchElasticEnvironment``)
and the process group already initialised, and trains in the processes it was
given: so a ``Trainer`` runs inside ``course_lib.run`` like any function. Both
runs below see the same shards of the same data from the same initial weights,
so their losses agree to float precision, step by step::

    run(lightning_losses, steps=5, nproc=2)[0] ≈ run(our_losses, steps=5, nproc=2)[0]
"""
from __future__ import annotations

import logging
import os
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.data import regression_batch
from course_lib.models import deep_mlp
from course_lib.runtime.backend import current_device

PER_RANK, LR = 8, 0.1


def _shard():
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = regression_batch(PER_RANK * world, seed=1)
    return x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]


def _mean_over_ranks(values):
    losses = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(losses)
    return (losses / dist.get_world_size()).tolist()


def _accelerator():
    """Lightning's name for where this rank computes: NCCL ranks own a GPU each."""
    return "gpu" if dist.get_backend() == "nccl" else "cpu"


def our_losses(steps=5):
    """Per-step training loss (mean over ranks) of our DDP, SGD on a deep MLP."""
    from course_lib.ddp.bucketed import DDP

    device = current_device()
    model = DDP(deep_mlp(32, 2, seed=0).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = (t.to(device) for t in _shard())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return _mean_over_ranks(losses)


def lightning_losses(steps=5):
    """The same run as :func:`our_losses` with ``Trainer(strategy="ddp")``."""
    try:
        import pytorch_lightning as pl
    except ImportError as exc:  # an optional piece: say how to get it
        raise ImportError("this demo needs PyTorch Lightning: pip install "
                          "'pytorch-lightning>=2.6' (make setup installs it)") from exc
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = deep_mlp(32, 2, seed=0)
            self.losses = []

        def training_step(self, batch, _index):
            loss = F.mse_loss(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    module = Regression()
    # one batch per step, this rank's shard: Lightning's own DistributedSampler off
    loader = DataLoader(TensorDataset(*_shard()), batch_size=PER_RANK)
    # devices per node and nodes, as torchrun started them
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    with _quiet_lightning():
        trainer = pl.Trainer(strategy="ddp", accelerator=_accelerator(), devices=per_node,
                             num_nodes=dist.get_world_size() // per_node, max_steps=steps,
                             use_distributed_sampler=False, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(module, loader)
    return _mean_over_ranks(module.losses)


@contextmanager
def _quiet_lightning():
    """Lightning's banner lines and a deprecation warning from its pytree helper
    say nothing about the run: keep them out of the notebook."""
    logger = logging.getLogger("pytorch_lightning")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LeafSpec.*")
            yield
    finally:
        logger.setLevel(level)
