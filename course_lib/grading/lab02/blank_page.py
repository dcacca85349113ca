"""The check of Exercise 2.6: a whole bucketed DDP class, written from a blank page.

The student's class wraps a four-layer MLP whose parameter sizes no bucket cap divides
evenly, on real gloo ranks at world sizes 2 and 3, from different weights per rank
(:mod:`.blank_page_jobs`). What it reports is judged here, in this order, so that each
mistake is named by the first symptom it has:

1. the weights right after construction are rank 0's on every rank (the broadcast);
2. when ``loss.backward()`` returns, every all-reduce launched has been waited for;
3. the gradients after each of ``STEPS`` backward passes: the first against one process
   on the whole batch (a factor K or this rank's own gradient is named as such), every
   one against torch's ``DistributedDataParallel`` on the same shards;
4. one all-reduce per bucket of the cap, from the last parameter to the first (the
   first step may send everything as one bucket, as torch's first iteration does);
5. asynchronous all-reduces, the first one launched before backward's last gradient
   hook: overlap, read from the order of events on the rank, not from durations;
6. ``no_sync()``: no all-reduce inside it, and after the synchronised micro-batch the
   gradient of the whole batch;
7. a layer forward never calls: training goes on, with torch's gradients.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib.grading import checks, salt
from course_lib.grading.lab02 import blank_page_jobs as jobs
from course_lib.grading.lab02 import messages
from course_lib.grading.lab02.references import expected_buckets
from course_lib.grading.requests import on_ranks

EX = "Exercise 2.6"


def whole_batch_gradients(world):
    """(first-step gradients of one process on the whole batch, each rank's own gradient
    on its shard), both from rank 0's weights."""
    x, y = jobs.batch(world)

    def grads(rows):
        net = jobs.model(0)
        F.mse_loss(net(x[rows]), y[rows]).backward()
        return [p.grad for p in net.parameters()]

    return grads(slice(None)), [grads(jobs.shard(r)) for r in range(world)]


def bucket_plans():
    """Element counts of the buckets the cap makes, walking the parameters from last to
    first (right) and from first to last (the forward-order mistake)."""
    numels = [p.numel() for p in jobs.model(0).parameters()]

    def plan(numels):  # expected_buckets walks its list from the end (float32: 4 bytes)
        return [sum(numels[i] for i in bucket)
                for bucket in expected_buckets([4 * k for k in numels], jobs.CAP_BYTES)]

    return plan(numels), plan(numels[::-1]), len(numels)


def _expect_grads(got, want, rank, n, what, hint, rtol=1e-5, atol=1e-6):
    for i, (g, w) in enumerate(zip(got, want)):
        checks.expect_close(EX, g, w, rank=rank, world_size=n, rtol=rtol, atol=atol,
                            what=f"the gradient of parameter {i} {tuple(w.shape)} {what}",
                            hint=hint)


def _judge_start(outs, n):
    """Every rank first: a rank left with its own weights spoils rank 0's gradients too."""
    start = [p.detach() for p in jobs.model(0).parameters()]
    for rank, out in enumerate(outs):
        if not all(torch.equal(g, w) for g, w in zip(out["synced"]["start"], start)):
            raise checks.CheckFailed(messages.not_broadcast(EX, rank, n), exercise=EX)


def _judge_synced(out, theirs, first, local, rank, n):
    plan, forward_plan, params = bucket_plans()
    for step, seen in enumerate(out["steps"], 1):
        if seen["unwaited"]:
            raise checks.CheckFailed(messages.not_waited(EX, rank, n, step, seen["unwaited"],
                                                         len(seen["sizes"])), exercise=EX)
    steps = out["steps"]
    messages.diagnose_gradient(EX, steps[0]["grads"], first, local, rank, n,
                               messages.BLANK_PAGE_HINT)
    for step, (seen, want) in enumerate(zip(steps, theirs["synced"]), 1):
        _expect_grads(seen["grads"], want, rank, n, f"after backward of step {step} (vs "
                      f"torch's DistributedDataParallel)", messages.BLANK_PAGE_HINT)
    for step, seen in enumerate(steps, 1):
        if step == 1 and seen["sizes"] == [sum(plan)]:
            continue  # torch's first iteration: one bucket, rebuilt in the order seen
        problem = messages.bucket_problem(EX, rank, n, step, seen["sizes"], plan, forward_plan,
                                          params, jobs.CAP_BYTES)
        if problem:
            raise checks.CheckFailed(problem, exercise=EX)
    last = steps[-1]
    if last["blocking"]:
        raise checks.CheckFailed(messages.blocking(EX, rank, n, last["blocking"]), exercise=EX)
    if not last["before_last_grad"]:
        raise checks.CheckFailed(messages.nothing_overlapped(EX, rank, n, len(last["sizes"]),
                                                             last["after_end"]), exercise=EX)


def _judge_no_sync(out, first, rank, n):
    if out["inside"]:
        raise checks.CheckFailed(messages.reduced_inside_no_sync(EX, rank, n, out["inside"],
                                                                 jobs.MICRO), exercise=EX)
    _expect_grads(out["grads"], first, rank, n,
                  f"after {jobs.MICRO - 1} micro-batches inside no_sync() and one outside "
                  f"(vs one process on the whole batch)",
                  "the synchronised backward must all-reduce what .grad holds when its hook "
                  "fires: the sum over every micro-batch of the step")


def _judge_unused(out, theirs, rank, n):
    if "raised" in out:
        raise checks.CheckFailed(messages.unused_raised(EX, n, out["raised"]), exercise=EX)
    for step, (got, want) in enumerate(zip(out["steps"], theirs["unused"]), 1):
        _expect_grads(got, want, rank, n, f"at step {step} of a model with a layer forward "
                      f"never calls (vs torch's DDP with find_unused_parameters=True)",
                      "a parameter whose hook never fired contributes zeros to its bucket")


@checks.check(EX, hidden=salt.draw)
def check_ddp_from_blank_page(ddp_cls, world_sizes=(2, 3)):
    for n in world_sizes:
        outs = yield on_ranks(jobs.ddp_job, ddp_cls, nproc=n, timeout=120)
        theirs = checks.reference_ranks(jobs.torch_reference, nproc=n)
        first, local = whole_batch_gradients(n)
        _judge_start(outs, n)
        for rank, (out, ref) in enumerate(zip(outs, theirs)):
            _judge_synced(out["synced"], ref, first, local, rank, n)
            _judge_no_sync(out["no_sync"], first, rank, n)
            _judge_unused(out["unused"], ref, rank, n)
    plan, _, _ = bucket_plans()
    return (f"world sizes {list(world_sizes)}: gradients as torch's DDP for {jobs.STEPS} "
            f"steps, {len(plan)} bucket all-reduces per step from the last layer, the first "
            f"launched during backward, none inside no_sync(), an unused layer handled")
