"""Training data that needs no download, and sharding it across ranks.

- :func:`char_corpus` a small public-domain text shipped with the package,
  turned into (input, next-token) windows for the GPT;
- :func:`regression_batch` synthetic (x, y) pairs for the MLP;
- :class:`ShardedSampler` what ``DistributedSampler`` does: every epoch, a
  seeded permutation (the same on every rank), padded to a multiple of the world
  size, and rank r takes every K-th index starting at r, so the ranks see
  disjoint shards of equal size.
"""
from __future__ import annotations

from pathlib import Path

import torch

TEXT = Path(__file__).with_name("corpus.txt")


def char_corpus(seq_len, text=None):
    """(inputs, targets, vocab): all windows of ``seq_len`` characters, targets
    shifted by one. The vocabulary is the text's sorted set of characters."""
    text = text if text is not None else TEXT.read_text()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long, device="cpu")
    n = (len(ids) - 1) // seq_len
    inputs = ids[: n * seq_len].view(n, seq_len)
    targets = ids[1: n * seq_len + 1].view(n, seq_len)
    return inputs, targets, chars


def regression_batch(n, inputs=32, outputs=10, seed=0):
    """x ~ N(0, 1), y = a fixed random linear map of x plus noise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inputs, generator=gen, device="cpu")
    w = torch.randn(inputs, outputs, generator=torch.Generator().manual_seed(12345), device="cpu")
    return x, x @ w / inputs**0.5 + 0.1 * torch.randn(n, outputs, generator=gen, device="cpu")


class ShardedSampler:
    """Indices of one rank's shard of a dataset of ``length`` items."""

    def __init__(self, length, rank, world_size, shuffle=True, seed=0, drop_last=False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.length, self.rank, self.world = length, rank, world_size
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0

    def set_epoch(self, epoch):
        """Reshuffle: without it every epoch repeats the same order."""
        self.epoch = epoch

    def __len__(self):
        if self.drop_last:
            return self.length // self.world
        return -(-self.length // self.world)

    def __iter__(self):
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=gen, device="cpu").tolist()
        else:
            order = list(range(self.length))
        total = len(self) * self.world
        if self.drop_last:
            order = order[:total]
        elif order:  # pad by repeating from the start (as often as it takes, when the
            # dataset is smaller than the world) so that every rank gets as many
            missing = total - len(order)
            order += (order * -(-missing // len(order)))[:missing]
        return iter(order[self.rank:total:self.world])


def batches(inputs, targets, sampler, batch_size):
    """Yield (input, target) batches of one rank's shard, in sampler order."""
    index = list(sampler)
    for start in range(0, len(index) - batch_size + 1, batch_size):
        chosen = torch.tensor(index[start:start + batch_size], device="cpu")
        yield inputs[chosen], targets[chosen]
