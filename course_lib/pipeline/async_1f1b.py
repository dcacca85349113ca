"""PipeDream's asynchronous 1F1B, executed: an update after every backward, and weight stashing.

PipeDream never flushes. Stage s of p runs the 1F1B order over a stream of
microbatches (p-s-1 forwards to warm up, then one forward and one backward in
turn) and takes an optimizer step after every backward. Write W_s^(k) for stage
s's weights after k updates. The forward of microbatch i on stage s runs on
W_s^(f), f = max(0, i-(p-s-1)) being the updates made before it, and when its
backward comes stage s has made i updates: the staleness i - f is p-s-1 in the
steady state and 0 on the last stage (:func:`~course_lib.pipeline.simulate.weight_versions`).

Weight stashing: the backward of microbatch i must run on W_s^(f), the version its
forward ran on; on any other version the gradient belongs to weights that neither
produced the activations nor the gradient that came back from stage s+1. So stage
s keeps one version per microbatch in flight, at most p-s of them, and its update

    W_s^(k+1) = W_s^(k) - lr * grad of L_i at W_s^(f)

applies a gradient taken on a stashed version to the newest one: the delayed update
that :func:`replay` computes in one process from the schedule alone.

:func:`async_1f1b` runs m microbatches this way on the ranks of a pipeline group,
through :func:`~course_lib.pipeline.executor.pipeline_step` (its messages, shapes
and posting order) with a forward and a backward of its own::

    F(i): stash.save(i, module); y = module(x), no graph kept; keep x
    B(i): with stash.restore(i, module): module(x).backward(grad)
          stash.drop(i); optimizer.step()

The backward recomputes the forward on the restored weights instead of keeping the
forward's graph: that graph would hold the parameters, which the optimizer updates
in place before the backward comes, and autograd refuses to differentiate through
tensors changed since it saved them. On the restored version the recomputation is
the forward itself, so the gradient is the one the kept graph would have given.

A stash is any object with ``save(microbatch, module)``, ``restore(microbatch,
module)`` (a context manager) and ``drop(microbatch)``: :class:`WeightStash` (Lab 04's
Exercise 4.5), or :class:`NoStash`, which shows what goes wrong without one. The run's
:class:`VersionLog` records which version each forward and backward actually ran on
(the weights in place, matched against every version the stage has had) and the
bytes the stash holds after each action (:mod:`~course_lib.pipeline.versions`).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.func import functional_call

from course_lib.pipeline.executor import pipeline_step
from course_lib.pipeline.partition import even_split
from course_lib.pipeline.schedules import one_f_one_b
from course_lib.pipeline.simulate import weight_versions
from course_lib.pipeline.stage import PipelineStage, mlp_stage
from course_lib.pipeline.versions import VersionLog
from course_lib.runtime.backend import current_device


class WeightStash:
    """PipeDream's weight stashing on one stage: a copy of the weights each
    microbatch's forward used, put in place for that microbatch's backward."""

    def __init__(self):
        self.versions = {}  # microbatch -> copies of the parameters its forward ran on

    def save(self, microbatch, module):
        # copies: the optimizer steps the parameters in place before this backward comes
        self.versions[microbatch] = [p.detach().clone() for p in module.parameters()]

    @contextmanager
    def restore(self, microbatch, module):
        params = list(module.parameters())
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, saved in zip(params, self.versions[microbatch]):
                p.copy_(saved)
        try:
            yield
        finally:  # the update applies to the newest version, whatever the backward did
            with torch.no_grad():
                for p, now in zip(params, current):
                    p.copy_(now)

    def drop(self, microbatch):
        del self.versions[microbatch]


class NoStash:
    """No weight stashing: every backward runs on the weights current at that moment."""

    def save(self, microbatch, module):
        pass

    @contextmanager
    def restore(self, microbatch, module):
        yield

    def drop(self, microbatch):
        pass


def async_1f1b(stage, stash, optimizer, m, batch=None, targets=None, loss_fn=None):
    """Run m microbatches of PipeDream's asynchronous 1F1B on ``stage`` (every rank of
    the pipeline group calls it with its own), stepping ``optimizer`` after every
    backward and handing the weight versions to ``stash``; returns the stage's
    :class:`VersionLog`. ``batch`` on stage 0, ``targets`` and ``loss_fn`` on the last,
    as for :func:`~course_lib.pipeline.executor.pipeline_step`. Each microbatch is a
    minibatch of its own: its loss is ``loss_fn`` on its rows alone."""
    module, log = stage.module, VersionLog(stage.module)

    def forward(stage, i, x, target, weight):
        stash.save(i, module)
        log.forwarded(i, stash)
        with torch.no_grad():  # the backward recomputes this, on the version stashed now
            y = module(x)
            if stage.is_last:
                loss = stage.loss_fn(y, target)
                log.losses[i] = loss.item()
                y = loss * weight  # the executor adds these up to the mean over all rows
        stage.stash[i] = (x, target)
        return y

    def backward(stage, i, grad):
        x, target = stage.stash.pop(i)
        if not stage.is_first and x.is_floating_point():
            x = x.detach().requires_grad_()
        optimizer.zero_grad()
        with stash.restore(i, module):
            log.backward_starts(i)
            y = module(x)
            (stage.loss_fn(y, target) if stage.is_last else y).backward(grad)
        stash.drop(i)
        log.backward_ended(i, stash)
        optimizer.step()
        log.updated()
        if stage.is_first or not x.is_floating_point():
            return None
        return x.grad if x.grad is not None else torch.zeros_like(x)

    pipeline_step(stage, one_f_one_b(stage.n_stages, m), batch=batch, targets=targets,
                  loss_fn=loss_fn, forward_step=forward, backward_step=backward)
    return log


def replay(modules, batch, targets, loss_fn, lr, m):
    """The same run in one process, from the schedule alone: microbatch i goes through
    every stage s on the version W_s^(f) that :func:`weight_versions` gives its
    forward, the gradient of its loss is taken at those versions, and each stage's
    SGD update W_s^(k+1) = W_s^(k) - lr * g applies it to the newest version.
    ``modules[s]`` is stage s (left as it is). Returns each stage's weights after the
    m updates, by parameter name."""
    p = len(modules)
    schedule = one_f_one_b(p, m)
    forward_version = [{i: f for i, (f, _) in row.items()} for row in weight_versions(schedule)]
    names = [[name for name, _ in mod.named_parameters()] for mod in modules]
    history = [[[q.detach().clone() for q in mod.parameters()]] for mod in modules]
    xs, ys = batch.tensor_split(m), targets.tensor_split(m)
    for i in (a.microbatch for a in schedule[0] if a.kind == "B"):  # every stage's order
        used = [[w.clone().requires_grad_() for w in history[s][forward_version[s][i]]]
                for s in range(p)]
        h = xs[i]
        for s, mod in enumerate(modules):
            h = functional_call(mod, dict(zip(names[s], used[s])), (h,))
        grads = iter(torch.autograd.grad(loss_fn(h, ys[i]), [w for ws in used for w in ws],
                                         allow_unused=True))
        for s in range(p):
            history[s].append([torch.add(w, g if g is not None else torch.zeros_like(w),
                                         alpha=-lr)
                               for w, g in zip(history[s][-1], grads)])
    return [dict(zip(names[s], history[s][-1])) for s in range(p)]


def mlp_stages(sizes, p):
    """The MLP of widths ``sizes`` (:func:`~course_lib.pipeline.stage.uneven_mlp`) cut into
    p stages of about as many modules each, every stage built alone, with its weights
    rescaled to LeCun's std 1/sqrt(fan_in). At the course's N(0, 0.02) the signal fades
    through the tanh layers, and the first stage's gradients are so small that its
    weights after 5 updates at lr 0.1 differ by 1e-8 with and without a stash."""
    stages = [mlp_stage(sizes, r) for r in even_split(2 * (len(sizes) - 1) - 1, p)]
    if any(not list(stage.parameters()) for stage in stages):
        raise ValueError(f"an MLP of widths {list(sizes)} cut into {p} stages leaves a stage "
                         f"without weights: use fewer stages")
    with torch.no_grad():
        for weight in (w for stage in stages for w in stage.parameters() if w.dim() == 2):
            weight.mul_(1 / (0.02 * weight.shape[1] ** 0.5))
    return stages


def async_mlp(stash_cls, sizes, x, y, m, lr=0.1):
    """On every rank: stage s of the MLP of widths ``sizes`` trained on m microbatches
    of (x, y) by asynchronous 1F1B with SGD(lr) and ``stash_cls()``; returns the
    stage's log (:meth:`VersionLog.as_dict`) and its weights after the m updates."""
    s, p = dist.get_rank(), dist.get_world_size()
    device = current_device()
    module = mlp_stages(sizes, p)[s].to(device)
    stage = PipelineStage(module, s, p)
    log = async_1f1b(stage, stash_cls(), torch.optim.SGD(module.parameters(), lr=lr), m,
                     batch=x.to(device) if stage.is_first else None,
                     targets=y.to(device) if stage.is_last else None, loss_fn=F.mse_loss)
    return {**log.as_dict(),
            "state": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}}
