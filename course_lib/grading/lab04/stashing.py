"""The check of Lab 04's weight stash, written from a blank page (Exercise 4.5).

The library's asynchronous 1F1B (:mod:`course_lib.pipeline.async_1f1b`) trains an MLP
of Exercise 4.3's widths (weights at LeCun's scale, so that staleness shows in the
first stage) on real gloo ranks, 3 stages and then 2, one SGD update after
every backward, with the student's stash in every stage
(:func:`~course_lib.pipeline.async_1f1b.async_mlp`). Each stage logs which weight
version every forward and backward ran on and the bytes the stash held after each
action; here the logs are read against what 1F1B's order implies
(:func:`~course_lib.pipeline.versions.expected_versions`), which tells the likely
mistake apart, and the weights against one process applying the same delayed
updates (:func:`~course_lib.pipeline.async_1f1b.replay`). Three stages come first:
with two, a stage never holds a version other than its newest and the oldest in
flight, so restoring the wrong microbatch's version cannot be told from restoring
none.
"""
from __future__ import annotations

import torch.nn.functional as F

from course_lib.grading import checks, salt
from course_lib.grading.lab04.jobs import LR, MLP_SIZES, data
from course_lib.grading.requests import on_ranks
from course_lib.pipeline import one_f_one_b
from course_lib.pipeline.async_1f1b import async_mlp, mlp_stages, replay
from course_lib.pipeline.versions import expected_versions

M, ROWS = 5, 11  # m a multiple of neither depth, 11 rows cut into unequal microbatches


def in_flight(p, m, s):
    """After each action of stage s in 1F1B: the microbatches whose forward has run
    and whose backward has not (the versions a stash must hold then)."""
    held, out = [], []
    for action in one_f_one_b(p, m)[s]:
        if action.kind == "F":
            held.append(action.microbatch)
        else:
            held.remove(action.microbatch)
        out.append(list(held))
    return out


def _judge_versions(ex, where, got, want, p, s, held_any):
    """Raise CheckFailed for the first backward that ran on a version other than its
    forward's, preferring evidence of another microbatch's version (see the module)."""
    forward_of = {i: w[0] for i, w in enumerate(want)}
    for i, ((f_got, *_), (f, *_)) in enumerate(zip(got, want)):
        if f_got != f:
            raise checks.CheckFailed(
                f"{where}: the forward of microbatch {i} ran on "
                f"{'weights that match no version' if f_got is None else f'version {f_got}'}, "
                f"not on the stage's current weights (version {f}).\nHint: save copies the "
                f"weights and leaves the module as it is; the forward runs on what is in "
                f"place.", exercise=ex)
    wrong = [(i, g[1], w) for i, (g, w) in enumerate(zip(got, want)) if g[1] != w[1]]
    for i, used, (f, _, now, _) in wrong:
        others = [j for j, v in forward_of.items() if v == used and j != i]
        if used is not None and used != now and others:
            raise checks.CheckFailed(
                f"{where}: the backward of microbatch {i} ran on version {used}, the one "
                f"microbatch {others[-1]}'s forward used; its own forward used version {f}."
                f"\nHint: stage {s} holds up to {p - s} versions at once, one per microbatch in "
                f"flight: keep them by microbatch, and restore the one saved for the "
                f"microbatch restore is given (a single slot is overwritten by the forwards "
                f"run in between; the latest version saved is the newest microbatch's).",
                exercise=ex)
    for i, used, (f, _, now, _) in wrong:
        if used is None:
            raise checks.CheckFailed(
                f"{where}: during the backward of microbatch {i} the module held weights that "
                f"match no version this stage has had (its forward used version {f}).\nHint: "
                f"restore copies every parameter of the saved version into the module, in the "
                f"order module.parameters() gives them, before the backward (the yield).",
                exercise=ex)
        hint = ("your stash held no tensors at all: save must keep a copy of every "
                "parameter (p.detach().clone())" if not held_any else
                "in restore, copy the version saved for this microbatch into the parameters "
                "before the yield, and the current weights back after it")
        raise checks.CheckFailed(
            f"{where}: the backward of microbatch {i} ran on version {used}, the current "
            f"weights, but its forward ran on version {f}: {now - f} update(s) later. Without "
            f"weight stashing the gradient is taken at weights that produced neither the "
            f"activations nor the gradient that came back from stage {s + 1}.\nHint: {hint}.",
            exercise=ex)


def _judge_stage(ex, n, s, out, reference):
    where = f"{ex}: stage {s} of {n}, asynchronous 1F1B over m={M} microbatches"
    if out["aliased"]:
        raise checks.CheckFailed(
            f"{where}: your stash holds the parameters themselves (tensors sharing their "
            f"storage), not copies. The optimizer steps the parameters in place, so the "
            f"'stashed' version changes with every update and the backward runs on the current "
            f"weights.\nHint: save p.detach().clone() for each parameter (detach() alone, or "
            f"state_dict(), shares the storage).", exercise=ex)
    got, want = out["versions"], expected_versions(n, M)[s]
    if len(got) != M:
        raise checks.CheckFailed(f"{where}: the stage logged {len(got)} microbatches, "
                                 f"expected {M}.", exercise=ex)
    _judge_versions(ex, where, got, want, n, s, any(out["held"]))
    for i, (_, used, now, restored) in enumerate(got):
        if not restored:
            raise checks.CheckFailed(
                f"{where}: after the backward of microbatch {i} (on version {used}) the "
                f"module did not hold the current weights (version {now}) again. The update "
                f"then applies to an old version and the updates made since are lost.\nHint: "
                f"restore is a context manager: after its yield, copy the weights it replaced "
                f"back into the parameters.", exercise=ex)
    per_version = out["version_bytes"]
    for k, (held, flight) in enumerate(zip(out["held"], in_flight(n, M, s))):
        versions = held / per_version
        if versions > len(flight) + 0.5:
            after = one_f_one_b(n, M)[s][k]
            raise checks.CheckFailed(
                f"{where}: after {after} the stash holds {versions:.1f} versions' bytes, but "
                f"only {len(flight)} microbatch(es) are in flight ({flight}); after the last "
                f"backward it holds {out['held'][-1] / per_version:.1f} (expected 0).\nHint: "
                f"drop(microbatch) must delete that microbatch's version: stage s keeps at most "
                f"p-s versions, one per microbatch in flight, and PipeDream's memory bound "
                f"rests on it.", exercise=ex)
    for name, tensor in out["state"].items():
        checks.expect_close(ex, tensor, reference[name], rank=s, world_size=n, rtol=1e-5,
                            atol=1e-6, what=f"{name} after {M} asynchronous updates, vs one "
                            f"process applying the same delayed updates",
                            hint="the versions match, so look at what restore puts back and "
                                 "at what save copies (every parameter, in order)")


@checks.check("Exercise 4.5", hidden=salt.draw)
def check_weight_stash(stash_cls, world_sizes=(3, 2)):
    ex = "Exercise 4.5"
    x, y = data(ROWS)
    for n in world_sizes:
        outs = yield on_ranks(async_mlp, stash_cls, MLP_SIZES, x, y, M, LR, nproc=n,
                              timeout=90)
        references = replay(mlp_stages(MLP_SIZES, n), x, y, F.mse_loss, LR, M)
        for s, out in enumerate(outs):
            _judge_stage(ex, n, s, out, references[s])
    return (f"pipeline depths {list(world_sizes)}, m={M}: every backward on its forward's "
            f"version, one version per microbatch in flight, weights as one process applying "
            f"the same delayed updates")
