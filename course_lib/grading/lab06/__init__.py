"""Checks of Lab 06's exercises: the capstone.

6.1 (ranks to mesh coordinates, and the groups) compares the student's
arithmetic with :class:`~course_lib.mesh.ParallelDims` for many shapes, odd ones
included, then builds the student's groups on 4 real ranks for three layouts
and asserts each group's members and that a collective over it sums exactly
those ranks. 6.2 (parameters per rank under each strategy) and 6.3 (choosing a
mesh for a real run) are arithmetic: the student's functions run in the
student's process, and their answers are judged here against the library's
formulas and a brute-force search. Predictions 6.1 (the bytes a pipeline stage
sends) and 6.2 (model state per GPU on a mesh): :mod:`.predictions`; Exercise 6.4
(DP x TP x PP at once, from a blank page): :mod:`.three_d`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.grading import checks
from course_lib.grading.lab06.cases import (LAUNCHED, PARAM_CASES, SHAPES, drawn_param_cases,
                                            drawn_plans, drawn_shapes, plan_cases)
from course_lib.grading.lab06.predictions import (check_p2p_bytes_prediction,
                                                  check_state_bytes_prediction)
from course_lib.grading.lab06.three_d import check_three_d
from course_lib.grading.requests import call_each, here, on_ranks
from course_lib.mesh import DIMS, ParallelDims

EX_COORDS, EX_PARAMS, EX_PLAN = (f"Exercise 6.{i}" for i in range(1, 4))


# ---- on the student's side ----------------------------------------------------------------
def groups_job(build_groups, shapes):
    """On a rank: for each shape, the student's groups' members and the sum of the
    global ranks an all-reduce over each group gives."""
    out = []
    for pp, dp, tp in shapes:
        groups = build_groups(pp, dp, tp)
        found = {}
        for name in DIMS:
            group = groups[name] if isinstance(groups, dict) and name in groups else None
            if group is None:
                found[name] = None
                continue
            total = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(total, group=group)
            found[name] = (list(dist.get_process_group_ranks(group)), int(total.item()))
        out.append(found)
    return out


def meshes(choose_mesh, cases):
    """``choose_mesh(...)`` for each case, its value tagged: a Mesh as ("M", dp, tp, pp),
    other plain data as ("P", value), anything else as ("S", its repr)."""
    from course_lib.submission import plain
    from course_lib.hybrid.plan import Mesh

    answers = call_each(choose_mesh, [(case, {}) for case in cases])
    for answer in answers:
        if "value" in answer:
            got = answer["value"]
            tagged = ("M", got.dp, got.tp, got.pp) if isinstance(got, Mesh) else ("P", got)
            try:
                plain.encode(tagged)
            except plain.NotPlain:
                tagged = ("S", repr(got)[:300])
            answer["value"] = tagged
    return answers


# ---- 6.1: ranks to coordinates, and the groups ---------------------------------------------
def _layout_hint():
    return ("the layout puts tp fastest, then dp, then pp: rank = (pp_i * dp + dp_i) * tp + "
            "tp_i; the group along a dim holds the ranks that share the other two "
            "coordinates, ordered by the coordinate along that dim")


def _expect(ex, answer, want, what):
    if "raised" in answer:
        raise checks.CheckFailed(f"{ex}: {what} raised {answer['raised']}: {answer['message']}",
                                 exercise=ex)
    got = answer["value"]
    if isinstance(got, list):
        got = tuple(got)
    if got != want:
        raise checks.CheckFailed(f"{ex}: {what}: expected {want!r}, got {got!r}.\nHint: "
                                 f"{_layout_hint()}.", exercise=ex)


@checks.check(EX_COORDS, hidden=drawn_shapes)
def check_mesh_groups(coords_of, group_ranks, build_groups, shapes=tuple(SHAPES)):
    ex = EX_COORDS
    ranks = [(shape, rank) for shape in shapes for rank in range(shape[0] * shape[1] * shape[2])]
    coords = yield here(call_each, coords_of, [((rank, *shape), {}) for shape, rank in ranks])
    groups = yield here(call_each, group_ranks, [((name, rank, *shape), {})
                                                 for shape, rank in ranks for name in DIMS])
    for i, ((pp, dp, tp), rank) in enumerate(ranks):
        dims = ParallelDims(pp=pp, dp=dp, tp=tp)
        shape = f"pp={pp}, dp={dp}, tp={tp}"
        _expect(ex, coords[i], tuple(dims.coords_of(rank)), f"coords_of({rank}) with {shape}")
        for j, name in enumerate(DIMS):
            _expect(ex, groups[i * len(DIMS) + j], tuple(dims.group_ranks(name, rank)),
                    f"group_ranks({name!r}, {rank}) with {shape}")
    outs = yield on_ranks(groups_job, build_groups, LAUNCHED, nproc=4)
    for rank, per_shape in enumerate(outs):
        for (pp, dp, tp), found in zip(LAUNCHED, per_shape):
            dims = ParallelDims(pp=pp, dp=dp, tp=tp)
            for name in DIMS:
                want = dims.group_ranks(name, rank)
                where = f"rank {rank} of 4, pp={pp}, dp={dp}, tp={tp}, the {name} group"
                if found[name] is None:
                    raise checks.CheckFailed(
                        f"{ex}: {where}: build_groups returned no group for {name!r}.\nHint: "
                        f"return a dict with a process group for each of 'pp', 'dp' and 'tp' "
                        f"(a dim of size 1 too: a group of one rank).", exercise=ex)
                members, total = found[name]
                if sorted(members) != sorted(want):
                    raise checks.CheckFailed(
                        f"{ex}: {where} holds ranks {members}, expected {want}.\nHint: "
                        f"{_layout_hint()}. Every rank must call dist.new_group for every "
                        f"group of every dim, in the same order, and keep the one it is in.",
                        exercise=ex)
                if total != sum(want):
                    raise checks.CheckFailed(
                        f"{ex}: {where}: an all-reduce of the global ranks over it gave "
                        f"{total}, expected {sum(want)} (the sum over {want}).", exercise=ex)
    return (f"{len(shapes)} shapes by arithmetic, 3 layouts of 4 real ranks: members and an "
            f"all-reduce over each group")


# ---- 6.2: parameters per rank ----------------------------------------------------------
PARAM_HINTS = {
    "dp": "every rank holds the whole model",
    "dp_tp": "a block's matrices (q/k/v, projection, both MLP layers) and the column layers' "
             "biases are split t ways; its LayerNorms and the row layers' biases (the "
             "projection's and the second MLP layer's) stay whole, as do the embeddings and "
             "the head",
    "dp_pp": "the stages are course_lib.pipeline.partition(gpt_piece_costs(cfg), p): take the "
             "parameters of the pieces of the largest stage",
    "dp_fsdp": "each unit (a block; the root: embeddings, final LayerNorm and head) is "
               "flattened, padded to a multiple of n and cut into n equal shards",
}


@checks.check(EX_PARAMS, hidden=drawn_param_cases)
def check_params_per_rank(params_per_rank, cases=tuple(PARAM_CASES)):
    from course_lib.hybrid.table import params_per_rank as expected

    ex = EX_PARAMS
    answers = yield here(call_each, params_per_rank, [(case, {}) for case in cases])
    for (name, cfg, dp, inner), answer in zip(cases, answers):
        call = f"params_per_rank({name!r}, {cfg}, dp={dp}, inner={inner})"
        if "raised" in answer:
            raise checks.CheckFailed(f"{ex}: {call} raised {answer['raised']}: "
                                     f"{answer['message']}", exercise=ex)
        want, got = expected(name, cfg, dp, inner), answer["value"]
        if got != want:
            raise checks.CheckFailed(f"{ex}: {call} = {got!r}, expected {want}.\nHint: "
                                     f"{PARAM_HINTS[name]}.", exercise=ex)
    return f"{len(cases)} cases of the four strategies, uneven splits included"


# ---- 6.3: choosing a mesh for a real run ------------------------------------------------
class _Shown:
    """What the student's function returned, where it was not plain data: its repr."""

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text


def _mesh_of(got):
    """The Mesh an answer names (a Mesh, or a (dp, tp, pp) tuple of ints), else None."""
    from course_lib.hybrid.plan import Mesh

    if isinstance(got, Mesh):
        return got
    if isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(v, int) for v in got):
        return Mesh(*got)
    return None


@checks.check(EX_PLAN, hidden=drawn_plans)
def check_choose_mesh(choose_mesh, cases=None):
    from course_lib.hybrid import plan

    ex = EX_PLAN
    shown, models = plan_cases()
    cases = shown if cases is None else cases
    answers = yield here(meshes, choose_mesh, [(models[name], n, work, gpu)
                                               for name, n, work, gpu in cases])
    for (name, n, work, gpu), answer in zip(cases, answers):
        shape = models[name]
        call = f"choose_mesh({name}, {n} x {gpu.name}, {work})"
        tag, *value = answer.get("value", ("P", None))
        got = plan.Mesh(*value) if tag == "M" else _Shown(value[0]) if tag == "S" else value[0]
        if "raised" in answer and answer["raised"] != "ValueError":
            raise checks.CheckFailed(f"{ex}: {call} raised {answer['raised']}: "
                                     f"{answer['message']}", exercise=ex)
        try:
            want, best = plan.best_mesh(shape, n, work, gpu)
        except ValueError as exc:
            if "raised" in answer:
                continue
            raise checks.CheckFailed(
                f"{ex}: {call} returned {got!r}, but no mesh fits ({exc}).\nHint: raise "
                f"ValueError when no valid mesh fits in memory.", exercise=ex) from None
        if "raised" in answer:
            raise checks.CheckFailed(
                f"{ex}: {call} raised ValueError ({answer['message']}), but {want} fits.\nHint: "
                f"skip the meshes that cannot run (plan.step_time raises on a batch that does "
                f"not split) and those that do not fit; raise only when none is left.",
                exercise=ex)
        mesh = _mesh_of(got)
        if mesh is None:
            raise checks.CheckFailed(f"{ex}: {call} returned {got!r}; return a plan.Mesh "
                                     f"(or a (dp, tp, pp) tuple).", exercise=ex)
        valid = plan.valid_meshes(shape, n, work, gpu.gpus_per_node)
        if mesh not in valid:
            raise checks.CheckFailed(
                f"{ex}: {call} chose {mesh}, which cannot run: dp*tp*pp must be {n}, tp "
                f"must divide the {shape.heads} heads and the {gpu.gpus_per_node} GPUs of "
                f"a node, pp at most the {shape.layers} layers, and the "
                f"global batch of {work.global_batch} must split into dp replicas of "
                f"microbatches of {work.micro_batch}.", exercise=ex)
        if not plan.fits(shape, mesh, work, gpu):
            need = plan.memory_per_gpu(shape, mesh, work)["total"] / 1e9
            raise checks.CheckFailed(
                f"{ex}: {call} chose {mesh}, which needs {need:.1f} GB per GPU: more than "
                f"plan.fits allows on {gpu.memory_gb:g} GB.\nHint: only meshes that fit "
                f"can be chosen.", exercise=ex)
        mine = plan.step_time(shape, mesh, work, gpu)["total"]
        if mine > best["total"] * (1 + 1e-9):
            raise checks.CheckFailed(
                f"{ex}: {call} chose {mesh}: {mine:.3f} s per step, but {want} fits and "
                f"takes {best['total']:.3f} s.\nHint: compare every valid mesh that fits, "
                f"by plan.step_time(...)['total'].", exercise=ex)
    return f"{len(cases)} runs of OLMo 1B/7B/70B on A100s and H100s, against a brute-force search"


__all__ = ["check_mesh_groups", "check_params_per_rank", "check_choose_mesh", "SHAPES",
           "LAUNCHED", "PARAM_CASES", "plan_cases", "check_p2p_bytes_prediction",
           "check_state_bytes_prediction", "check_three_d"]
