"""What Lab 02's checks tell a student: hints, and diagnoses that name the likely
mistake behind a wrong answer (run in the checking process, on plain data)."""
from __future__ import annotations

import torch

from course_lib.grading import checks
from course_lib.grading.lab02.references import STEPS, expected_buckets

AVERAGE_HINT = ("each rank's gradient is the gradient of its own shard's mean loss; the whole "
                "batch's is their average: the SUM all-reduce divided by the world size, once")
BUCKETED_HINT = ("mark each parameter ready in its hook, launch complete buckets in order, and "
                 "wait + copy back at the end")
SAME_GRADIENTS_HINT = "every rank must end backward with the same averaged gradients"


def accumulation_hint(k):
    return (f"with a mean loss, the step's gradient is the mean over micro-batches: divide each "
            f"micro-batch's loss by the number of micro-batches ({k})")


def ratio(got, want, rtol=1e-3, atol=1e-5):
    """``got`` as a multiple of ``want`` (least squares), or None if not one."""
    got, want = torch.cat([g.flatten() for g in got]), torch.cat([w.flatten() for w in want])
    scale = float(got @ want / (want @ want))
    return scale if torch.allclose(got, scale * want, rtol=rtol, atol=atol) else None


def diagnose_gradient(ex, first_grads, want, local, rank, world, hint):
    """Name the mistake behind a wrong step-1 gradient, when it has a shape."""
    if all(torch.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(first_grads, want)):
        return
    where = f"{ex}: rank {rank} of world size {world}, the gradients after the first backward"
    if world > 1 and all(torch.allclose(g, w, rtol=1e-4, atol=1e-6)
                         for g, w in zip(first_grads, local[rank])):
        raise checks.CheckFailed(
            f"{where} are this rank's own gradients, not averaged over ranks.\nHint: all-reduce "
            f"each p.grad (the gradient, not p.data) and divide by the world size.")
    scale = ratio(first_grads, want)
    if scale is not None:
        raise checks.CheckFailed(
            f"{where} are {scale:.2f}x the expected ones (the gradient of one process on the "
            f"whole batch).\nHint: {hint}")


def diagnose_buckets(sizes, cap, got):
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
    if got != expected_buckets(sizes, cap):  # not reached by any mistake seen so far
        return (f"expected {expected_buckets(sizes, cap)}.\nHint: walk the indices from last "
                f"to first, close a bucket with the parameter that takes it to at least "
                f"cap_bytes, and put what is left in a last bucket.")
    return None


def launch_order_problem(ex, rank, n, launched, buckets):
    """The message for buckets launched in the order they completed, or None."""
    if sorted(launched) == list(range(buckets)) and launched != sorted(launched):
        return (f"{ex}: rank {rank} of world size {n} launched the buckets in the order "
                f"{launched}, the order they completed. In this model bucket "
                f"{launched[0]} completes first, but bucket 0 must go first on every rank.\n"
                f"Hint: launch bucket i only once buckets 0..i-1 are launched: a loop "
                f"from the next unlaunched bucket while it is complete.")
    return None


def no_overlap(ex, rank, n):
    return (f"{ex}: rank {rank} of world size {n} launched no bucket before the last "
            f"gradient hook fired: the all-reduces all start at the end of backward, "
            f"so nothing overlaps.\nHint: launch a bucket from the hook that "
            f"completes it (and all buckets before it), not once everything is ready.")


def no_sync_problem(ex, rank, n, k, per_step):
    return (f"{ex}: rank {rank} of world size {n}, {k} micro-batches: one step "
            f"all-reduced the gradients {per_step} times, once per "
            f"micro-batch.\nHint: run the forward AND backward of every "
            f"micro-batch but the last inside `with model.no_sync():` (the forward "
            f"decides whether its backward synchronises).")


def diagnose_hook_training(ex, mine, theirs, bucket_of, rank, n):
    """The first step and parameters where DDP with the student's hook (``mine``: each
    step's gradients) left torch's (``theirs``)."""
    for step, (got_step, want_step) in enumerate(zip(mine, theirs)):
        # two bf16 roundings of each gradient, and torch's buckets cut elsewhere
        wrong = [i for i, (got, want) in enumerate(zip(got_step, want_step))
                 if not torch.allclose(got, want, rtol=2e-2, atol=2e-3)]
        if not wrong:
            continue
        buckets = sorted({bucket_of[i] for i in wrong})
        where = (f"{ex}: rank {rank} of world size {n}, training the library's DDP with your "
                 f"hook against torch's bf16_compress_hook: at step {step + 1} of {STEPS}, "
                 f"the averaged gradients of parameter(s) {wrong} (in bucket(s) {buckets} of "
                 f"{len(set(bucket_of.values()))}) differ, though your hook averaged "
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
