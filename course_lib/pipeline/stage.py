"""One rank's part of a pipelined model, and building those parts.

:class:`PipelineStage` wraps the layers stage s holds; :func:`forward_step`
and :func:`backward_step` are what a stage does with one microbatch (the
executor, :mod:`course_lib.pipeline.executor`, moves the tensors between
stages and decides when each runs)::

    y = forward_step(stage, mb, x, target, weight)   # keeps (x, y) in stage.stash[mb]
    g = backward_step(stage, mb, grad_y)              # frees them; returns x's gradient

Builders give stage s of a model with the *full* model's weights, without
building the rest: parameters are named as in the full model and seeded by
name (:func:`course_lib.models.init_deterministic`), so a stage's
``state_dict()`` is a slice of the whole model's.

    module = gpt_stage(cfg, stage=1, n_stages=3)   # blocks chosen by partition()
    module = mlp_stage([13, 40, 7, 29, 5], layers=range(2, 5))
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.models import Block, GPTConfig, init_deterministic
from course_lib.pipeline.partition import partition
from course_lib.runtime.backend import current_device


class PipelineStage:
    """Stage ``stage`` of ``n_stages``: this rank's ``module`` and its place in
    the pipeline group (stage s is group-local rank s of ``group``; None: the
    world). The executor fills ``stash`` (microbatch -> what the backward needs)
    and, after each step, ``peak_in_flight`` (the most microbatches stashed at
    once) and, with ``measure_activations``, ``peak_activation_bytes`` (bytes of
    the tensors autograd saved for those microbatches, parameters excluded).

    In a traced run the executor records a span per action and, with
    ``trace_messages``, one per message; on gloo a message's span costs a thread
    hand-off, so bubble measurements turn it off."""

    def __init__(self, module, stage, n_stages, group=None, measure_activations=False,
                 trace_messages=True):
        if not isinstance(n_stages, int) or n_stages < 1:
            raise ValueError(f"n_stages must be a positive integer, got {n_stages!r}")
        if not isinstance(stage, int) or not 0 <= stage < n_stages:
            raise ValueError(f"stage must be in [0, {n_stages}), got {stage!r}")
        if n_stages > 1 or dist.is_initialized():
            if not dist.is_initialized():
                raise ValueError("a pipeline of several stages needs an initialised process group")
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            if size != n_stages:
                raise ValueError(f"the pipeline group has {size} ranks but n_stages={n_stages}: "
                                 f"one rank per stage")
            if rank != stage:
                raise ValueError(f"this rank is rank {rank} of the pipeline group but was given "
                                 f"stage={stage}: stage s must be group-local rank s")
        self.module, self.stage, self.n_stages, self.group = module, stage, n_stages, group
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.prev, self.next = stage - 1, stage + 1  # group-local ranks of the neighbours
        self.device = current_device()
        self.measure_activations = measure_activations
        self.trace_messages = trace_messages
        self.loss_fn = None  # set by the executor on every step
        self.stash = {}
        self.peak_in_flight = 0
        self.peak_activation_bytes = None
        self.steps = 0
        self.output_templates = {}  # (input dtype, input shape after rows) -> same for the output

    def __repr__(self):
        return f"PipelineStage({self.stage}/{self.n_stages}, {type(self.module).__name__})"

    def parameters(self):
        return self.module.parameters()


def forward_step(stage, microbatch, x, target=None, weight=1.0):
    """The forward of one microbatch on ``stage``; returns what goes on: the
    output (sent to the next stage) or, on the last stage, the weighted loss.

    A received activation becomes a leaf that requires its gradient: its
    ``.grad`` after backward is what this stage sends back. The last stage
    scales the loss by ``weight`` (the microbatch's share of the batch, 1/m when
    the batch splits evenly) so that the gradients accumulated over the m
    microbatches are the full-batch mean loss's."""
    if not stage.is_first and x.is_floating_point():
        x.requires_grad_()
    y = stage.module(x)
    if stage.is_last:
        y = stage.loss_fn(y, target) * weight
    stage.stash[microbatch] = (x, y)
    return y.detach()


def backward_step(stage, microbatch, grad=None):
    """The backward of one microbatch on ``stage``, given the gradient of its
    output (None on the last stage, whose output is the loss). Frees what
    :func:`forward_step` stashed and returns the gradient of the input, to send
    to the previous stage (None on the first stage)."""
    x, y = stage.stash.pop(microbatch)
    if y.requires_grad:
        y.backward(None if stage.is_last else grad)
    if stage.is_first or not x.is_floating_point():
        return None
    return x.grad if x.grad is not None else torch.zeros_like(x)


# ---- the course GPT, cut into pieces ----------------------------------------------------
def gpt_pieces(cfg: GPTConfig):
    """Names of the GPT's N + 2 pieces, in order: the embeddings, each block, the head."""
    return ["embed"] + [f"blocks.{i}" for i in range(cfg.layers)] + ["head"]


def gpt_piece_costs(cfg: GPTConfig):
    """Forward multiply-adds per token of each piece: a profile-free proxy for
    their times (a lookup for the embeddings; 12D^2 + 2TD per block, the
    attention counted over the whole context; DV for the head)."""
    d, t = cfg.dim, cfg.seq_len
    return [d] + [12 * d * d + 2 * t * d] * cfg.layers + [d * cfg.vocab]


class GPTStage(nn.Module):
    """Pieces ``pieces`` (a range over :func:`gpt_pieces`) of the course GPT,
    parameter names and values as in ``GPT(cfg, seed)``."""

    def __init__(self, cfg: GPTConfig, pieces: range, seed: int = 0):
        super().__init__()
        n = cfg.layers + 2
        if len(pieces) == 0 or pieces.start < 0 or pieces.stop > n or pieces.step != 1:
            raise ValueError(f"pieces must be a non-empty range within [0, {n}), got {pieces!r}")
        self.cfg, self.pieces = cfg, pieces
        self.has_embed, self.has_head = 0 in pieces, n - 1 in pieces
        self.pos_offset = 0  # the position of x's first token (context parallelism: its chunk's)
        if self.has_embed:
            self.tok = nn.Embedding(cfg.vocab, cfg.dim)
            self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleDict(
            (str(i - 1), Block(cfg)) for i in pieces if 1 <= i <= cfg.layers)
        if self.has_head:
            self.ln_f = nn.LayerNorm(cfg.dim)
            self.head = nn.Linear(cfg.dim, cfg.vocab)
        init_deterministic(self, seed)

    def forward(self, x):  # tokens (B, T) or activations (B, T, D) -> (B, T, D) or logits
        if self.has_embed:
            start = self.pos_offset
            x = self.tok(x) + self.pos(torch.arange(start, start + x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.has_head:
            x = self.head(self.ln_f(x))
        return x


def gpt_stage(cfg: GPTConfig, stage: int, n_stages: int, seed: int = 0, ranges=None):
    """Stage ``stage`` of the GPT cut into ``n_stages`` (``ranges``, default:
    :func:`~course_lib.pipeline.partition.partition` of :func:`gpt_piece_costs`)."""
    ranges = ranges or partition(gpt_piece_costs(cfg), n_stages)
    return GPTStage(cfg, ranges[stage], seed)


# ---- MLPs as nn.Sequential --------------------------------------------------------------
def mlp_layer(sizes, index):
    """Module ``index`` of the MLP with layer widths ``sizes``: Linear, Tanh, Linear, ... Linear."""
    count = 2 * (len(sizes) - 1) - 1
    if not 0 <= index < count:
        raise ValueError(f"an MLP of widths {list(sizes)} has modules 0..{count - 1}, got {index}")
    if index % 2:
        return nn.Tanh()
    k = index // 2
    return nn.Linear(sizes[k], sizes[k + 1])


def uneven_mlp(sizes, seed=0):
    """The whole MLP (widths ``sizes``) as one ``nn.Sequential``, weights seeded by name."""
    count = 2 * (len(sizes) - 1) - 1
    return init_deterministic(nn.Sequential(*(mlp_layer(sizes, i) for i in range(count))), seed)


def mlp_stage(sizes, layers: range, seed=0):
    """Modules ``layers`` of :func:`uneven_mlp` built alone, keeping their index as
    their name (so ``"4.weight"`` is the full model's ``"4.weight"``)."""
    stage = nn.Sequential(OrderedDict((str(i), mlp_layer(sizes, i)) for i in layers))
    return init_deterministic(stage, seed)


def sequential_stage(model: nn.Sequential, layers: range):
    """Modules ``layers`` of an existing ``nn.Sequential``, keeping their names."""
    names = list(model._modules)
    return nn.Sequential(OrderedDict((names[i], model[i]) for i in layers))
