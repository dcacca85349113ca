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


OVERLAP_HINT = ("launch a bucket from the hook that completes it (and every bucket before "
                "it that is complete), not once all gradients are there.")


def no_overlap(ex, rank, n):
    return (f"{ex}: rank {rank} of world size {n} launched no bucket before the last "
            f"gradient hook fired: the all-reduces all start at the end of backward, "
            f"so nothing overlaps.\nHint: {OVERLAP_HINT}")


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


# ---- Exercise 2.6: a whole DDP class ---------------------------------------------------------
BLANK_PAGE_HINT = ("in each parameter's hook copy p.grad into its bucket's flat buffer; when a "
                   "bucket is full, all-reduce it (SUM, async_op=True); at the end of backward "
                   "wait for every bucket, divide by the world size once and copy the buffers "
                   "back into the .grad tensors")


def not_broadcast(ex, rank, n):
    return (f"{ex}: rank {rank} of world size {n}: right after your class wrapped the model, "
            f"this rank's parameters are still its own (each rank built the model from "
            f"another seed), not rank 0's.\nHint: in __init__, broadcast every parameter "
            f"(and buffer) from rank 0 of the process group, under torch.no_grad(), before "
            f"anything else: dist.broadcast(p.data, group=process_group, group_src=0).")


def not_waited(ex, rank, n, step, unwaited, launched):
    return (f"{ex}: rank {rank} of world size {n}, step {step}: when loss.backward() "
            f"returned, {unwaited} of the {launched} all-reduces your class launched had "
            f"not been waited for, so the optimizer would read gradients that may still "
            f"be in flight (a race: right on a fast run, wrong on a slow one).\nHint: in "
            f"the callback that runs at the end of backward, call .wait() on the work of "
            f"every bucket before copying its buffer back into the .grad tensors.")


def bucket_problem(ex, rank, n, step, sizes, plan, forward_plan, params, cap_bytes):
    """What is wrong with the all-reduces of one synchronised backward (``sizes``, their
    element counts in issue order) against ``plan``, the element counts of the buckets
    that ``cap_bytes`` makes from the last parameter to the first; None when they match."""
    if sizes == plan:
        return None
    where = (f"{ex}: rank {rank} of world size {n}, step {step}: backward issued "
             f"{len(sizes)} all-reduce(s) of {sizes} elements")
    want = (f"expected {len(plan)}, one per bucket the cap of {cap_bytes} bytes makes, of "
            f"{plan} elements in this order")
    if not sizes:
        hint = ("no dist.all_reduce call was seen. Call it as dist.all_reduce(buffer, "
                "group=..., async_op=True): a name imported on its own (from "
                "torch.distributed import all_reduce) cannot be watched")
    elif sizes == forward_plan:
        hint = ("these are the buckets of the parameters taken first to last, in forward "
                "order. Backward produces the last layer's gradients first: fill the "
                "buckets walking the parameters from last to first (your assign_buckets "
                "of Exercise 2.2)")
    elif len(sizes) == params:
        hint = ("one all-reduce per parameter: put the gradients of a bucket in one flat "
                "buffer and all-reduce that buffer once")
    elif sorted(sizes) == sorted(plan):
        hint = ("the right buckets in another order: launch bucket i only after buckets "
                "0..i-1, on every rank")
    else:
        hint = ("bucket_cap_mb is in MiB (cap = int(bucket_cap_mb * 2**20) bytes, 4 bytes "
                "a float32); walk the parameters from last to first and close a bucket "
                "with the parameter that takes it to at least the cap")
    return f"{where}; {want}.\nHint: {hint}."


def blocking(ex, rank, n, count):
    return (f"{ex}: rank {rank} of world size {n}: {count} all-reduce(s) in the last "
            f"backward were blocking (async_op=False): backward stood still while each "
            f"bucket travelled.\nHint: launch each bucket with dist.all_reduce(..., "
            f"async_op=True), keep the work, and wait for it at the end of backward.")


def reduced_inside_no_sync(ex, rank, n, count, micro):
    return (f"{ex}: rank {rank} of world size {n}: {count} all-reduce(s) were issued during "
            f"the {micro - 1} micro-batches run inside `with model.no_sync():`.\nHint: "
            f"no_sync() turns synchronisation off for the forward and backward passes "
            f"inside it (set a flag on entry, restore it on exit, also when an exception "
            f"leaves the block); the hooks then leave .grad to accumulate and launch nothing.")


def unused_raised(ex, n, raised):
    return (f"{ex}: world size {n}, a model with a layer that forward never calls (its "
            f"parameters' hooks never fire): training it with your class raised {raised}\n"
            f"Hint: at the end of backward, launch the buckets still waiting, with zeros "
            f"for the gradients that never came, so every bucket goes out on every rank.")


def nothing_overlapped(ex, rank, n, launched, after_end):
    when = (f"{after_end} of them only after backward had computed every gradient" if after_end
            else "all of them from the last hook, once every gradient was there")
    return (f"{ex}: rank {rank} of world size {n}, the last step: none of the {launched} "
            f"all-reduces started before the last gradient hook of backward fired ({when}), "
            f"so no bucket travelled while backward computed.\nHint: {OVERLAP_HINT}")
