"""Lab 06's cases, in one place: the grids, models and runs its checks use, as the notebook
shows them, and the gradebook's hidden ones, drawn per student
(:mod:`course_lib.grading.hidden`)."""
from __future__ import annotations

from course_lib.hybrid import plan
from course_lib.memory.estimate import OLMO
from course_lib.models import GPTConfig

# (pp, dp, tp): every dim alone, pairs, odd sizes, and a 3-D grid
SHAPES = [(1, 1, 1), (1, 4, 1), (1, 1, 4), (4, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1),
          (1, 3, 2), (3, 2, 1), (2, 3, 1), (2, 2, 2), (3, 1, 3), (2, 3, 2)]
LAUNCHED = [(1, 2, 2), (2, 2, 1), (2, 1, 2)]  # on 4 ranks


def drawn_shapes(rng):
    """The gradebook's hidden (pp, dp, tp): grids the notebook does not show."""
    shapes = []
    while len(shapes) < 3:
        shape = tuple(rng.randint(1, 4) for _ in range(3))
        if shape not in SHAPES and shape not in shapes and shape[0] * shape[1] * shape[2] <= 32:
            shapes.append(shape)
    return {"shapes": tuple(shapes)}


PARAM_CASES = [  # (strategy, cfg, dp, inner): sizes that split evenly, and ones that do not
    ("dp", GPTConfig(vocab=65, dim=32, layers=2, heads=4, seq_len=16), 2, 2),
    ("dp_tp", GPTConfig(vocab=65, dim=32, layers=2, heads=4, seq_len=16), 2, 2),
    ("dp_tp", GPTConfig(vocab=50, dim=24, layers=3, heads=6, seq_len=8), 1, 3),
    ("dp_pp", GPTConfig(vocab=65, dim=32, layers=2, heads=4, seq_len=16), 2, 2),
    ("dp_pp", GPTConfig(vocab=50, dim=24, layers=5, heads=6, seq_len=8), 1, 3),
    ("dp_pp", GPTConfig(vocab=500, dim=16, layers=4, heads=4, seq_len=8), 2, 2),
    ("dp_fsdp", GPTConfig(vocab=65, dim=32, layers=2, heads=4, seq_len=16), 2, 2),
    ("dp_fsdp", GPTConfig(vocab=50, dim=24, layers=3, heads=6, seq_len=8), 1, 3),
    ("dp_fsdp", GPTConfig(vocab=7, dim=4, layers=1, heads=2, seq_len=3), 2, 5),
]


def drawn_param_cases(rng):
    """The gradebook's hidden cases: a model and a split of each strategy, drawn."""
    cases = []
    for name in ("dp", "dp_tp", "dp_pp", "dp_fsdp"):
        heads = rng.choice((1, 2, 4, 6))
        cfg = GPTConfig(vocab=rng.randint(5, 600), dim=heads * rng.randint(2, 8),
                        layers=rng.randint(1, 5), heads=heads, seq_len=rng.randint(2, 32))
        inner = {"dp": rng.randint(1, 4), "dp_fsdp": rng.randint(1, 7),
                 "dp_tp": rng.choice([t for t in range(1, heads + 1) if heads % t == 0]),
                 "dp_pp": rng.randint(1, cfg.layers)}[name]
        cases.append((name, cfg, rng.randint(1, 3), inner))
    return {"cases": tuple(cases)}


def plan_cases():
    """(model, GPUs, workload, gpu): the lecture's models at the sizes of the plan
    table, counts that are not powers of two, recompute with ZeRO-3, a batch that
    rules meshes out, and a model that fits on no mesh that can run."""
    work = plan.Workload()
    return [("OLMo 1B", 8, work, plan.A100_40GB), ("OLMo 1B", 12, work, plan.H100_80GB),
            ("OLMo 7B", 32, work, plan.H100_80GB), ("OLMo 7B", 32, work, plan.A100_40GB),
            ("OLMo 7B", 24, plan.Workload(global_batch=96, micro_batch=2), plan.H100_80GB),
            ("OLMo 70B", 256, work, plan.H100_80GB), ("OLMo 70B", 256, work, plan.A100_40GB),
            ("OLMo 70B", 64, plan.Workload(checkpointing=True, zero=3), plan.H100_80GB),
            # nothing fits: only a tp of 8, across two nodes, would (which cannot run)
            ("OLMo 70B", 64, work, plan.A100_40GB),
            ("OLMo 70B", 8, work, plan.A100_40GB)], OLMO


def drawn_plans(rng):
    """The gradebook's hidden runs: other models, GPU counts, GPUs and workloads."""
    works = [plan.Workload(), plan.Workload(checkpointing=True, zero=3),
             plan.Workload(global_batch=96, micro_batch=2)]
    return {"cases": tuple((rng.choice(sorted(OLMO)), rng.choice((8, 16, 24, 32, 48, 64, 128)),
                            rng.choice(works), rng.choice((plan.A100_40GB, plan.H100_80GB)))
                           for _ in range(3))}
