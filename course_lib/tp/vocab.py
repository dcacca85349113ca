"""The vocabulary split over the ranks: a vocab-parallel embedding and cross-entropy (stretch).

The two vocabulary-sized matrices of a GPT, the token embedding (V, h) and the
output layer (h, V), are often its largest. Megatron splits both by vocabulary:
rank r owns tokens r*V/t ... (r+1)*V/t - 1.

- **Embedding.** Each rank looks up only the tokens it owns and writes zeros for
  the others; g (an all-reduce) adds the t partial lookups, of which exactly one
  is non-zero per token. Backward needs nothing: g's backward is the identity,
  and a rank's rows receive gradient only from the tokens it owns.
- **Output layer and loss.** The output layer is column parallel, so rank r
  holds the logits of its own tokens, (..., V/t). Gathering all V logits would
  move b*s*V numbers; the loss needs far less. With z the logits and y the
  target: loss = log sum_j exp(z_j - m) - (z_y - m), m = max_j z_j for
  stability. Three all-reduces of b*s numbers each give it: the max (MAX), the
  target's logit (SUM: only its owner contributes), and the sum of exponentials
  (SUM). The gradient, softmax(z) - onehot(y), is then local to each rank's
  slice: backward communicates nothing.

    emb = VocabParallelEmbedding.from_dense(gpt.tok, group=tp)
    logits = ColumnParallelLinear.from_dense(gpt.head, group=tp)(h)     # (b, s, V/t)
    loss = vocab_parallel_cross_entropy(logits, targets, group=tp).mean()
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from course_lib.models import param_by_name
from course_lib.runtime.backend import current_device
from course_lib.tp.operators import (check_divides, ops_for, reduce_from_tp, tp_size_and_rank,
                                     traced_all_reduce)

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


def _owned(tokens, start, count):
    """(mask of the tokens in [start, start + count), their local ids, 0 elsewhere)."""
    mine = (tokens >= start) & (tokens < start + count)
    return mine, torch.where(mine, tokens - start, torch.zeros_like(tokens))


class VocabParallelEmbedding(nn.Module):
    """Rows r*V/t ... (r+1)*V/t - 1 of the (V, h) embedding on rank r; forward is
    g(this rank's lookups, zero for tokens it does not own), shape (..., h)."""

    def __init__(self, num_embeddings, embedding_dim, *, group=None, collectives="torch",
                 name="", seed=0, device=None, dtype=None):
        super().__init__()
        self.t, self.rank = tp_size_and_rank(group)
        ops_for(collectives)
        check_divides(num_embeddings, self.t, "num_embeddings (the vocabulary)")
        self.group, self.collectives = group, collectives
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_rank = num_embeddings // self.t
        self.start = self.rank * self.per_rank
        device = current_device() if device is None else device
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, device=device,
                                               dtype=dtype))
        if self.weight.device.type != "meta":
            full = param_by_name(f"{name}.weight" if name else "weight",
                                 (num_embeddings, embedding_dim), seed)
            with torch.no_grad():
                self.weight.copy_(full[self.start:self.start + self.per_rank])

    @classmethod
    def from_dense(cls, embedding, group=None, collectives="torch"):
        """This rank's rows of ``embedding`` (an ``nn.Embedding``), copied."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group=group,
                    collectives=collectives, device="meta", dtype=embedding.weight.dtype)
        layer.to_empty(device=embedding.weight.device)
        with torch.no_grad():
            layer.weight.copy_(embedding.weight[layer.start:layer.start + layer.per_rank])
        layer.weight.requires_grad_(embedding.weight.requires_grad)
        return layer

    def forward(self, tokens):
        mine, local = _owned(tokens, self.start, self.per_rank)
        partial = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return reduce_from_tp(partial, self.group, self.collectives)

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim}, t={self.t}, rank={self.rank}, "
                f"tokens [{self.start}, {self.start + self.per_rank})")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from vocab-split logits: 3 all-reduces of (...) forward, none backward."""

    @staticmethod
    def forward(ctx, logits, targets, group, collectives):
        t, rank = tp_size_and_rank(group)
        per_rank = logits.shape[-1]
        logits = logits.float()
        top = logits.max(dim=-1).values
        if t > 1:
            traced_all_reduce(top, group, collectives, "CE: all-reduce max", dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        mine, local = _owned(targets, rank * per_rank, per_rank)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        if t > 1:
            traced_all_reduce(target_logit, group, collectives, "CE: all-reduce target logit")
            traced_all_reduce(total, group, collectives, "CE: all-reduce sum of exp")
        exp.div_(total.unsqueeze(-1))  # now this rank's slice of the softmax
        ctx.save_for_backward(exp, local, mine)
        return total.log() - target_logit

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        softmax, local, mine = ctx.saved_tensors
        grad = softmax.scatter_add(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(softmax.dtype))
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits, targets, group=None, collectives="torch"):
    """Cross-entropy per token (shape of ``targets``) from this rank's slice of the
    logits, (..., V/t), and the global target ids; equals
    ``F.cross_entropy(full_logits, targets, reduction="none")`` without gathering
    the logits."""
    ops_for(collectives)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         f"must agree on every dimension but the last")
    return _VocabParallelCrossEntropy.apply(logits, targets, group, collectives)
