"""Lab 06's checks: pass the solutions, fail these plausible wrong answers with a message
that says what is wrong, and refuse the library's own planner."""
import random
import pytest
import torch.distributed as dist

from conftest import judged, ship_by_value
from course_lib.grading import checks, lab06
from course_lib.hybrid import plan
from course_lib.pipeline import gpt_piece_costs, partition

ship_by_value(__name__)


# ---- 6.1 -------------------------------------------------------------------------------
def coords_of(rank, pp, dp, tp):
    rest, tp_i = divmod(rank, tp)
    pp_i, dp_i = divmod(rest, dp)
    return pp_i, dp_i, tp_i


def group_ranks(dim, rank, pp, dp, tp):
    here = dict(zip(("pp", "dp", "tp"), coords_of(rank, pp, dp, tp)))
    return [(at["pp"] * dp + at["dp"]) * tp + at["tp"]
            for at in ({**here, dim: i} for i in range({"pp": pp, "dp": dp, "tp": tp}[dim]))]


def build_groups(pp, dp, tp):
    mine = {}
    for dim in ("pp", "dp", "tp"):
        made = []
        for rank in range(pp * dp * tp):
            members = group_ranks(dim, rank, pp, dp, tp)
            if members not in made:
                made.append(members)
        for members in made:
            group = dist.new_group(members)
            if dist.get_rank() in members:
                mine[dim] = group
    return mine


def coords_dp_fastest(rank, pp, dp, tp):  # the other common layout
    rest, dp_i = divmod(rank, dp)
    pp_i, tp_i = divmod(rest, tp)
    return pp_i, dp_i, tp_i


def group_ranks_reversed(dim, rank, pp, dp, tp):  # right members, wrong group-local order
    return group_ranks(dim, rank, pp, dp, tp)[::-1]


def groups_swapped(pp, dp, tp):  # the dp and pp groups handed back under each other's name
    groups = build_groups(pp, dp, tp)
    groups["dp"], groups["pp"] = groups["pp"], groups["dp"]
    return groups


def groups_without_tp(pp, dp, tp):
    groups = build_groups(pp, dp, tp)
    del groups["tp"]
    return groups


def test_coordinates_and_groups_pass_and_their_mistakes_fail(sandbox):
    lab06.check_mesh_groups(coords_of, group_ranks, build_groups)
    for seed in range(4):  # the gradebook's hidden grids
        lab06.check_mesh_groups(coords_of, group_ranks, build_groups,
                                **lab06.check_mesh_groups.hidden(random.Random(seed)))
    with pytest.raises(checks.CheckFailed, match=r"coords_of\(1\) with pp=1, dp=2, tp=2"):
        judged(sandbox, lab06.check_mesh_groups, coords_dp_fastest, group_ranks, build_groups)
    with pytest.raises(checks.CheckFailed, match=r"group_ranks\('dp', 0\) with pp=1, dp=4"):
        judged(sandbox, lab06.check_mesh_groups, coords_of, group_ranks_reversed, build_groups)
    with pytest.raises(checks.CheckFailed, match=r"the pp group holds ranks \[0, 2\], expected"):
        judged(sandbox, lab06.check_mesh_groups, coords_of, group_ranks, groups_swapped)
    with pytest.raises(checks.CheckFailed, match="returned no group for 'tp'"):
        judged(sandbox, lab06.check_mesh_groups, coords_of, group_ranks, groups_without_tp)


# ---- 6.2 -------------------------------------------------------------------------------
def pieces(cfg):
    d, v, t = cfg.dim, cfg.vocab, cfg.seq_len
    return d * (v + t), 12 * d * d + 10 * d, 2 * d + v * (d + 1)


def params_per_rank(name, cfg, dp, inner, split_norms=False, pad=True, even=False):
    embed, block, head = pieces(cfg)
    d, n = cfg.dim, cfg.layers
    if name == "dp":
        return embed + n * block + head
    if name == "dp_tp":
        if split_norms:
            return embed + n * block // inner + head
        return embed + n * ((12 * d * d + 4 * d) // inner + 6 * d) + head
    if name == "dp_pp":
        all_pieces = [embed] + [block] * n + [head]
        if even:
            size = -(-len(all_pieces) // inner)
            return max(sum(all_pieces[i:i + size]) for i in range(0, len(all_pieces), size))
        return max(sum(all_pieces[i] for i in r) for r in partition(gpt_piece_costs(cfg), inner))
    units = [embed + head] + [block] * n
    return sum((max(-(-u // inner), 1) if pad else u // inner) for u in units)


def test_parameters_per_rank_pass_and_their_mistakes_fail(sandbox):
    lab06.check_params_per_rank(params_per_rank)
    for seed in range(20):  # the gradebook's hidden models and splits
        lab06.check_params_per_rank(params_per_rank,
                                    **lab06.check_params_per_rank.hidden(random.Random(seed)))
    wrong = {
        "the row layers' biases": lambda *a: params_per_rank(*a, split_norms=True),
        "partition": lambda *a: params_per_rank(*a, even=True),
        "padded to a multiple of n": lambda *a: params_per_rank(*a, pad=False),
    }
    for hint, fn in wrong.items():
        with pytest.raises(checks.CheckFailed, match=hint):
            judged(sandbox, lab06.check_params_per_rank, fn)


# ---- 6.3 -------------------------------------------------------------------------------
def candidates(shape, n, work, gpu, check_batch=True, inside_node=True):
    for tp in range(1, (gpu.gpus_per_node if inside_node else n) + 1):
        if n % tp or shape.heads % tp or (inside_node and gpu.gpus_per_node % tp):
            continue
        for pp in range(1, shape.layers + 1):
            if (n // tp) % pp:
                continue
            dp = n // (tp * pp)
            if check_batch and work.global_batch % (dp * work.micro_batch):
                continue
            yield plan.Mesh(dp=dp, tp=tp, pp=pp)


def choose_mesh(shape, n, work, gpu, check_fit=True, check_batch=True, slowest=False,
                inside_node=True):
    timed = [(plan.step_time(shape, m, work, gpu)["total"], i, m)
             for i, m in enumerate(candidates(shape, n, work, gpu, check_batch, inside_node))
             if not check_fit or plan.fits(shape, m, work, gpu)]
    if not timed:
        raise ValueError("nothing fits")
    return (max if slowest else min)(timed)[2]


def never_gives_up(shape, n, work, gpu):  # pure data parallelism when nothing fits
    try:
        return choose_mesh(shape, n, work, gpu)
    except ValueError:
        return plan.Mesh(dp=n)


def by_the_library(shape, n, work, gpu):
    return plan.best_mesh(shape, n, work, gpu)[0]


def test_choosing_a_mesh_passes_and_its_mistakes_fail(sandbox):
    lab06.check_choose_mesh(choose_mesh)
    for seed in range(6):  # the gradebook's hidden runs
        lab06.check_choose_mesh(choose_mesh, **lab06.check_choose_mesh.hidden(random.Random(seed)))
    with pytest.raises(checks.CheckFailed, match="GB per GPU: more than plan.fits allows"):
        judged(sandbox, lab06.check_choose_mesh, lambda *a: choose_mesh(*a, check_fit=False))
    with pytest.raises(checks.CheckFailed, match="raised ValueError .*does not split"):
        judged(sandbox, lab06.check_choose_mesh, lambda *a: choose_mesh(*a, check_batch=False))
    with pytest.raises(checks.CheckFailed, match="cannot run: dp\\*tp\\*pp must be 8, tp must"):
        judged(sandbox, lab06.check_choose_mesh, lambda shape, n, *a: plan.Mesh(tp=n))
    with pytest.raises(checks.CheckFailed, match="but dp=.* fits and takes"):
        judged(sandbox, lab06.check_choose_mesh, lambda *a: choose_mesh(*a, slowest=True))
    with pytest.raises(checks.CheckFailed, match="no mesh fits"):
        judged(sandbox, lab06.check_choose_mesh, never_gives_up)
    # tensor parallelism across nodes makes 70B fit on 64 A100s: but it cannot run
    with pytest.raises(checks.CheckFailed, match=r"64 x A100 40GB.*returned .*tp=8"):
        judged(sandbox, lab06.check_choose_mesh, lambda *a: choose_mesh(*a, inside_node=False))


def test_the_librarys_planner_is_refused(monkeypatch, sandbox):
    monkeypatch.setenv("COURSE_LIB_REFERENCE_GUARD", "1")
    with pytest.raises(checks.CheckFailed, match="course_lib's own implementation"):
        judged(sandbox, lab06.check_choose_mesh, by_the_library)
