"""Checks of Lab 02's exercises: data-parallel training from scratch.

Correctness is always against a single process training the same model on the
whole (concatenated) batch. Ranks start from *different* random weights, so a
missing initial broadcast shows up, and gradients are compared across ranks.
The first step's gradient is compared with the full-batch one before anything
else, so that a factor (the sum instead of the average) is named as a factor.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.ddp import DDP
from course_lib.ddp.buckets import Bucket
from course_lib.ddp.comm_hooks import GradBucket
from course_lib.grading import checks
from course_lib.models import UseOrderMLP, deep_mlp

STEPS, PER_RANK, WIDTH, DEPTH, LR = 3, 4, 48, 3, 0.2


def _model(kind, seed):
    if kind == "use_order":  # layers used in another order than registered
        return UseOrderMLP(WIDTH, use_order=(0, 1, 3, 2), seed=seed)
    return deep_mlp(WIDTH, DEPTH, inputs=WIDTH, outputs=WIDTH, seed=seed)


def _data(world):
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(PER_RANK * world, WIDTH, generator=gen),
            torch.randn(PER_RANK * world, WIDTH, generator=gen))


def _single_process(world, kind="mlp"):
    """Parameters after each step and the first step's gradients, one process."""
    model = _model(kind, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data(world)
    first_grads = None
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if first_grads is None:
            first_grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return [p.detach() for p in model.parameters()], first_grads


def _train(wrap, sync=None, kind="mlp"):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(kind, seed=0 if rank == 0 else 1000 + rank)
    ddp = wrap(model)
    hooks_seen = []  # after each gradient hook of the last step: buckets launched so far
    for p in model.parameters():  # registered after the student's: they run after them
        p.register_post_accumulate_grad_hook(
            lambda _: hooks_seen.append(len(getattr(ddp, "launched", []))))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data(world)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    first_grads = None
    for _ in range(STEPS):
        opt.zero_grad()
        hooks_seen.clear()
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        if sync is not None:
            sync(model)
        if first_grads is None:
            first_grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return dict(params=[p.detach() for p in model.parameters()], first_grads=first_grads,
                grads=[p.grad.clone() for p in model.parameters()], hooks_seen=list(hooks_seen),
                launched=list(getattr(ddp, "launched", [])),
                buckets=len(getattr(ddp, "buckets", [])))


def _local_first_grads(world, kind="mlp"):
    """Each rank's own gradient at step 1 (its shard only, nothing averaged)."""
    x, y = _data(world)
    out = []
    for rank in range(world):
        model = _model(kind, seed=0)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        F.mse_loss(model(x[mine]), y[mine]).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def _ratio(got, want, rtol=1e-3, atol=1e-5):
    """``got`` as a multiple of ``want`` (least squares), or None if not one."""
    got, want = torch.cat([g.flatten() for g in got]), torch.cat([w.flatten() for w in want])
    scale = float(got @ want / (want @ want))
    return scale if torch.allclose(got, scale * want, rtol=rtol, atol=atol) else None


def _diagnose_gradient(ex, first_grads, want, local, rank, world, hint):
    """Name the mistake behind a wrong step-1 gradient, when it has a shape."""
    if all(torch.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(first_grads, want)):
        return
    where = f"{ex}: rank {rank} of world size {world}, the gradients after the first backward"
    if world > 1 and all(torch.allclose(g, w, rtol=1e-4, atol=1e-6)
                         for g, w in zip(first_grads, local[rank])):
        raise checks.CheckFailed(
            f"{where} are this rank's own gradients, not averaged over ranks.\nHint: all-reduce "
            f"each p.grad (the gradient, not p.data) and divide by the world size.")
    ratio = _ratio(first_grads, want)
    if ratio is not None:
        raise checks.CheckFailed(
            f"{where} are {ratio:.2f}x the expected ones (the gradient of one process on the "
            f"whole batch).\nHint: {hint}")


def _grade_training(ex, outs, world, hint, kind="mlp"):
    expected, want_first = _single_process(world, kind)
    local = _local_first_grads(world, kind)
    names = [f"parameter {i} ({tuple(p.shape)})" for i, p in enumerate(expected)]
    for rank, out in enumerate(outs):
        _diagnose_gradient(ex, out["first_grads"], want_first, local, rank, world, hint)
        for name, got, want in zip(names, out["params"], expected):
            checks.expect_close(ex, got, want, rank=rank, world_size=world, rtol=1e-4, atol=1e-5,
                                what=f"{name} after {STEPS} SGD steps (vs one process on the "
                                     f"whole batch)", hint=hint)
        for name, got, ref in zip(names, out["grads"], outs[0]["grads"]):
            checks.expect_close(ex, got, ref, rank=rank, world_size=world, rtol=0, atol=0,
                                what=f"the gradient of {name}, compared with rank 0's",
                                hint="every rank must end backward with the same averaged "
                                     "gradients")


def _broadcast_then(model):
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    return model


def check_average_gradients(average_gradients, world_sizes=(1, 2, 3)):
    ex = "Exercise 2.1"
    for n in world_sizes:
        outs = checks.launch(ex, _train, _broadcast_then, average_gradients, nproc=n)
        _grade_training(ex, outs, n, "each rank's gradient is the gradient of its own shard's "
                                     "mean loss; the whole batch's is their average: the SUM "
                                     "all-reduce divided by the world size, once")
    checks.passed(ex, f"world sizes {list(world_sizes)}, {STEPS} steps equal to one process")


def check_assign_buckets(assign_buckets, trials=200):
    ex = "Exercise 2.2"
    with checks.in_process(ex, assign_buckets):
        _grade_assign_buckets(ex, assign_buckets, trials)
    checks.passed(ex, f"{len(HAND_CASES)} hand-checked cases and {trials} random ones")


HAND_CASES = [([40, 40, 40, 40], 80), ([10, 100, 10], 50), ([5, 5, 5], 1000), ([7], 1),
              ([], 10), ([30, 50, 20, 60], 80)]


def _expected_buckets(sizes, cap):
    """The exercise's rule: from the last parameter to the first, close a bucket with
    the parameter that takes it to at least ``cap``; the rest is the last bucket."""
    buckets, current, filled = [], [], 0
    for index in reversed(range(len(sizes))):
        current.append(index)
        filled += sizes[index]
        if filled >= cap:
            buckets.append(current)
            current, filled = [], 0
    return buckets + ([current] if current else [])


def _diagnose_buckets(sizes, cap, got):
    """What is wrong with ``got`` as the bucket plan of ``sizes`` under ``cap``, as a
    message that names the likely mistake; None when it is right."""
    try:
        got = [list(b) for b in got]
    except TypeError:
        return (f"expected a list of buckets, each a list of parameter indices, got "
                f"{type(got).__name__}.\nHint: return a list such as [[3, 2], [1, 0]].")
    n = len(sizes)
    flat = [i for b in got for i in b]
    if not all(isinstance(i, int) and 0 <= i < n for i in flat):
        return (f"a bucket holds something that is not a parameter index in [0, {n}).\nHint: "
                f"store the index of each parameter, not its size.")
    twice = sorted({i for i in flat if flat.count(i) > 1})
    missing = sorted(set(range(n)) - set(flat))
    if twice or missing:
        what = "; ".join(([f"parameter(s) {missing} are in no bucket"] if missing else [])
                         + ([f"parameter(s) {twice} are in more than one bucket"]
                            if twice else []))
        if missing == list(range(len(missing))) and not twice:
            # the walk ends at index 0: what is missing is what was left open
            hint = ("the last bucket takes whatever is left: after the loop, append the "
                    "open bucket if it is not empty.")
        else:
            hint = ("put each index in exactly one bucket, and start a new, empty bucket "
                    "after closing one.")
        return f"{what}.\nHint: {hint}"
    empty = [k for k, b in enumerate(got) if not b]
    if empty:
        return (f"bucket(s) {empty} are empty.\nHint: close a bucket only right after adding "
                f"a parameter to it, and do not append an empty bucket at the end.")
    if n > 1 and flat == list(range(n)):
        return ("the buckets list the parameters first to last, in forward order.\nHint: "
                "backward produces the last layer's gradients first: walk the indices from "
                "last to first, reversed(range(len(sizes_bytes))).")
    if flat != list(reversed(range(n))):
        return (f"read bucket by bucket, the indices come in the order {flat}, not from last "
                f"to first.\nHint: keep the order in which you walked the parameters, "
                f"{n - 1}, {n - 2}, ..., 0, inside each bucket and across buckets.")
    for k, b in enumerate(got):
        total = sum(sizes[i] for i in b)
        before_last = total - sizes[b[-1]]
        if before_last >= cap:
            exact = before_last == cap
            return (f"bucket {k} {b} already held {before_last} bytes (cap {cap}) before "
                    f"parameter {b[-1]} went in.\nHint: close the bucket as soon as it holds "
                    f"at least cap_bytes" + (": the test is >=, not >." if exact else "."))
        if k < len(got) - 1 and total < cap:
            return (f"bucket {k} {b} was closed holding {total} bytes, under the cap of {cap}, "
                    f"though parameter {got[k + 1][0]} ({sizes[got[k + 1][0]]} bytes) came next."
                    f"\nHint: a bucket closes with the first parameter that takes it to at "
                    f"least cap_bytes, even if that parameter takes it over the cap: do not "
                    f"start a new bucket to stay under it.")
    if got != _expected_buckets(sizes, cap):  # not reached by any mistake seen so far
        return (f"expected {_expected_buckets(sizes, cap)}.\nHint: walk the indices from last "
                f"to first, close a bucket with the parameter that takes it to at least "
                f"cap_bytes, and put what is left in a last bucket.")
    return None


def _grade_assign_buckets(ex, assign_buckets, trials):
    rng = random.Random(0)
    cases = list(HAND_CASES)
    for _ in range(trials):
        cases.append(([rng.randint(1, 100) for _ in range(rng.randint(1, 30))],
                      rng.randint(1, 400)))
    for sizes, cap in cases:
        got = assign_buckets(list(sizes), cap)
        problem = _diagnose_buckets(sizes, cap, got)
        if problem:
            shown = got if not isinstance(got, (list, tuple)) else [list(b) for b in got]
            raise checks.CheckFailed(f"{ex}: assign_buckets({sizes}, cap_bytes={cap}) "
                                     f"returned {shown}: {problem}", exercise=ex)


def check_bucketed_ddp(make_ddp, world_sizes=(1, 2, 3)):
    """On a model whose layers run in another order than they are registered
    (so bucket 1 completes before bucket 0), one layer per bucket."""
    ex = "Exercise 2.3"
    layer_bytes = (WIDTH * WIDTH + WIDTH) * 4
    for n in world_sizes:
        outs = checks.launch(ex, _train, lambda m: make_ddp(m, layer_bytes / 2**20),
                             kind="use_order", nproc=n)
        _grade_training(ex, outs, n, "mark each parameter ready in its hook, launch complete "
                                     "buckets in order, and wait + copy back at the end",
                        kind="use_order")
        for rank, out in enumerate(outs):
            launched, buckets = out["launched"], out["buckets"]
            if sorted(launched) == list(range(buckets)) and launched != sorted(launched):
                raise checks.CheckFailed(
                    f"{ex}: rank {rank} of world size {n} launched the buckets in the order "
                    f"{launched}, the order they completed. In this model bucket "
                    f"{launched[0]} completes first, but bucket 0 must go first on every rank.\n"
                    f"Hint: launch bucket i only once buckets 0..i-1 are launched: a loop "
                    f"from the next unlaunched bucket while it is complete.")
            checks.expect_equal(ex, launched, list(range(buckets)), rank=rank, world_size=n,
                                what="the order the buckets were launched in (last step)",
                                hint="every bucket once per backward, in bucket order")
            seen = out["hooks_seen"]
            if buckets > 1 and len(seen) > 1 and seen[-2] == 0:
                raise checks.CheckFailed(
                    f"{ex}: rank {rank} of world size {n} launched no bucket before the last "
                    f"gradient hook fired: the all-reduces all start at the end of backward, "
                    f"so nothing overlaps.\nHint: launch a bucket from the hook that "
                    f"completes it (and all buckets before it), not once everything is ready.")
    checks.passed(ex, f"world sizes {list(world_sizes)}, {outs[0]['buckets']} buckets launched "
                      f"in order during backward")


def _counting_ddp(model, launches):
    def all_reduce(tensor):
        launches.append(tensor.numel())
        return dist.all_reduce(tensor, async_op=True)
    return DDP(model, bucket_cap_mb=64, all_reduce=all_reduce)


def _accumulate(train_step, micro_batches):
    rank, world = dist.get_rank(), dist.get_world_size()
    launches = []
    model = _counting_ddp(_model("mlp", seed=0 if rank == 0 else 1000 + rank), launches)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data(world)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    first_grads, per_step = None, []
    for _ in range(STEPS):
        before = len(launches)
        train_step(model, opt, x[mine], y[mine], micro_batches)
        per_step.append(len(launches) - before)
        if first_grads is None:
            first_grads = [p.grad.clone() for p in model.parameters()]
    return dict(params=[p.detach() for p in model.module.parameters()], first_grads=first_grads,
                grads=[p.grad.clone() for p in model.module.parameters()], per_step=per_step)


def check_accumulation(train_step, world_sizes=(1, 2, 3), micro_batches=(2, 4)):
    ex = "Exercise 2.4"
    for n in world_sizes:
        for k in micro_batches:
            outs = checks.launch(ex, _accumulate, train_step, k, nproc=n)
            for rank, out in enumerate(outs):
                if out["per_step"][0] > 1:
                    raise checks.CheckFailed(
                        f"{ex}: rank {rank} of world size {n}, {k} micro-batches: one step "
                        f"all-reduced the gradients {out['per_step'][0]} times, once per "
                        f"micro-batch.\nHint: run the forward AND backward of every "
                        f"micro-batch but the last inside `with model.no_sync():` (the forward "
                        f"decides whether its backward synchronises).")
            _grade_training(ex, outs, n, f"with a mean loss, the step's gradient is the mean "
                                         f"over micro-batches: divide each micro-batch's loss "
                                         f"by the number of micro-batches ({k})")
    checks.passed(ex, f"world sizes {list(world_sizes)}, {list(micro_batches)} micro-batches, "
                      f"one all-reduce per step, equal to one process on the whole batch")


def _run_hook(hook, numel):
    """The student's hook on one bucket of known gradients; then in a real DDP."""
    rank = dist.get_rank()
    param = torch.nn.Parameter(torch.zeros(numel))
    bucket = Bucket(0, [param])
    bucket.buffer.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(rank)))
    value = hook(None, GradBucket(bucket, is_last=True)).wait()
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return value.clone() if isinstance(value, torch.Tensor) else value


def _hook_training(hook):
    """The library's DDP with the student's hook and with torch's, side by side:
    the averaged gradients of every step, and the bucket each parameter sat in."""
    out = {}
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    for name, fn in (("student", hook), ("reference", bf16_compress_hook)):
        model = DDP(_model("mlp", seed=0), bucket_cap_mb=0.01)
        model.register_comm_hook(None, fn)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        x, y = _data(dist.get_world_size())
        mine = slice(dist.get_rank() * PER_RANK, (dist.get_rank() + 1) * PER_RANK)
        steps = []
        for _ in range(STEPS):
            opt.zero_grad()
            F.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
            # the gradients tell more than the weights: SGD moves a weight by lr x gradient
            steps.append([p.grad.clone() for p in model.module.parameters()])
        out[name] = steps
        out["bucket_of"] = {i: k for k, plan in enumerate(model.bucket_plan) for i in plan}
    return out


def _diagnose_hook_training(ex, out, rank, n):
    """The first step and parameters where DDP with the student's hook left torch's."""
    for step, (mine, theirs) in enumerate(zip(out["student"], out["reference"])):
        # two bf16 roundings of each gradient, and torch's buckets cut elsewhere
        wrong = [i for i, (got, want) in enumerate(zip(mine, theirs))
                 if not torch.allclose(got, want, rtol=2e-2, atol=2e-3)]
        if not wrong:
            continue
        buckets = sorted({out["bucket_of"][i] for i in wrong})
        where = (f"{ex}: rank {rank} of world size {n}, training the library's DDP with your "
                 f"hook against torch's bf16_compress_hook: at step {step + 1} of {STEPS}, "
                 f"the averaged gradients of parameter(s) {wrong} (in bucket(s) {buckets} of "
                 f"{len(set(out['bucket_of'].values()))}) differ, though your hook averaged "
                 f"one bucket right.")
        if step > 0:
            hint = ("step 1 agreed and a later one did not, so your hook carries something "
                    "from one call to the next (a cached tensor, a buffer kept from the first "
                    "bucket or step). Build everything from this call's bucket.buffer().")
        else:
            hint = ("DDP calls the hook once per bucket, several buckets per step, each of "
                    "another size: the hook must work on whichever bucket it is given and "
                    "return the future of that bucket's averaged buffer.")
        raise checks.CheckFailed(f"{where}\nHint: {hint}", exercise=ex)


def check_bf16_hook(hook, world_sizes=(1, 2, 3), numel=1001):
    ex = "Exercise 2.5"
    for n in world_sizes:
        outs = checks.launch(ex, _run_hook, hook, numel, nproc=n)
        inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
        average = sum(inputs) / n
        for rank, got in enumerate(outs):
            where = f"{ex}: rank {rank} of world size {n}"
            if not isinstance(got, torch.Tensor):
                raise checks.CheckFailed(f"{where}: the hook's future gave {type(got).__name__}, "
                                         f"not a tensor.\nHint: return a future whose value "
                                         f"is the bucket's averaged buffer.")
            checks.expect_equal(ex, (tuple(got.shape), got.dtype), ((numel,), torch.float32),
                                rank=rank, world_size=n, what="shape and dtype of the reduced "
                                "bucket", hint="cast the bf16 result back into the float32 "
                                "buffer (bucket.buffer().copy_(...)) and return that")
            ratio = _ratio([got], [average], rtol=2e-2, atol=0.03 * n)
            if ratio is not None and abs(ratio - 1) > 0.05:
                raise checks.CheckFailed(f"{where}: the reduced bucket is {ratio:.2f}x the "
                                         f"average.\nHint: divide by the group's size once "
                                         f"(dist.get_world_size(process_group)).")
            if not torch.equal(got, got.to(torch.bfloat16).float()):
                raise checks.CheckFailed(f"{where}: the reduced values are not bfloat16 "
                                         f"numbers, so the all-reduce sent float32.\nHint: "
                                         f"all-reduce `bucket.buffer().to(torch.bfloat16)`.")
            # bf16 keeps 8 significant bits: n roundings of |x| up to ~4 stay within this
            checks.expect_close(ex, got, average, rank=rank, world_size=n, rtol=0,
                                atol=0.03 * n, what="the averaged bucket (vs float32 average)",
                                hint="SUM all-reduce of the bf16 buffer divided by the size")
        trained = checks.launch(ex, _hook_training, hook, nproc=n)
        for rank, out in enumerate(trained):
            _diagnose_hook_training(ex, out, rank, n)
    checks.passed(ex, f"world sizes {list(world_sizes)}: bf16 on the wire, averaged, and "
                      f"{STEPS} DDP steps as torch's bf16_compress_hook")
