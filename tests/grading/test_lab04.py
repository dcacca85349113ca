"""Lab 04's checks: pass the solutions, fail the stubs and these plausible wrong answers."""
import random
import re

import pytest

from conftest import judged, ship_by_value
from course_lib.grading import checks, lab04
from course_lib.pipeline import Action

ship_by_value(__name__)


# ---- 4.1 and 4.2: schedules ---------------------------------------------------------------------
def gpipe_schedule(p, m):
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
            for _ in range(p)]


def gpipe_backwards_in_reverse(p, m):  # also GPipe: the backwards drain in the other order
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in reversed(range(m))]
            for _ in range(p)]


def gpipe_one_stage_only(p, m):
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]]


def one_f_one_b_schedule(p, m):
    out = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        acts = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action("F", warmup + i), Action("B", i)]
        out.append(acts + [Action("B", i) for i in range(m - warmup, m)])
    return out


def one_f_one_b_plain_tuples(p, m):  # ("F", 0) tuples work as well as Actions
    return [[tuple(a)[:2] for a in row] for row in one_f_one_b_schedule(p, m)]


def one_f_one_b_warmup_p_minus_s(p, m):  # one forward too many before the first backward
    out = []
    for s in range(p):
        warmup = min(p - s, m)
        acts = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action("F", warmup + i), Action("B", i)]
        out.append(acts + [Action("B", i) for i in range(m - warmup, m)])
    return out


def one_f_one_b_warmup_reversed(p, m):  # the last stage warms up the most
    out = []
    for s in range(p):
        warmup = min(s, m)
        acts = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action("F", warmup + i), Action("B", i)]
        out.append(acts + [Action("B", i) for i in range(m - warmup, m)])
    return out


def one_f_one_b_warmup_not_capped(p, m):  # forgets min(.., m): breaks when m < p
    out = []
    for s in range(p):
        warmup = p - s - 1
        acts = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action("F", warmup + i), Action("B", i)]
        out.append(acts + [Action("B", i) for i in range(max(m - warmup, 0), m)])
    return out


def one_f_one_b_that_is_gpipe(p, m):
    return gpipe_schedule(p, m)


def test_schedule_solutions_pass(capsys):
    lab04.check_gpipe(gpipe_schedule)
    lab04.check_gpipe(gpipe_backwards_in_reverse)
    lab04.check_one_f_one_b(one_f_one_b_schedule)
    lab04.check_one_f_one_b(one_f_one_b_plain_tuples)
    for check, schedule in ((lab04.check_gpipe, gpipe_schedule),
                            (lab04.check_one_f_one_b, one_f_one_b_schedule)):
        for seed in range(5):  # the gradebook's hidden (p, m)
            check(schedule, **check.hidden(random.Random(seed)))
    out = capsys.readouterr().out
    assert "✓ Exercise 4.1 passed" in out and "✓ Exercise 4.2 passed" in out


@pytest.mark.parametrize("check,wrong,fragments", [
    (lab04.check_gpipe, gpipe_one_stage_only, ["list of 2 lists", "Hint: every stage runs"]),
    (lab04.check_gpipe, one_f_one_b_schedule,
     ["stage 0 starts a backward before its last forward, but GPipe runs every forward",
      "first difference from the reference: stage 0, position 1: expected F1, got B0"]),
    (lab04.check_one_f_one_b, one_f_one_b_warmup_p_minus_s,
     ["p=1, m=2 stage 0 holds up to 2 microbatches' activations; 1F1B holds min\\(m, p-s\\) = 1",
      "stage 0 runs 2 forward\\(s\\) before its first backward; 1F1B runs min\\(m, p-s\\) = 1"]),
    (lab04.check_one_f_one_b, one_f_one_b_warmup_reversed,
     ["the schedule deadlocks", "The first stage warms up the most"]),
    (lab04.check_one_f_one_b, one_f_one_b_warmup_not_capped,
     ["names microbatch 1, outside \\[0, 1\\)", "the warm-up never exceeds m"]),
    (lab04.check_one_f_one_b, one_f_one_b_that_is_gpipe,
     ["stage 0 holds up to 2 microbatches' activations; 1F1B holds min\\(m, p-s\\) = 1"]),
])
def test_wrong_schedules_are_named(check, wrong, fragments, sandbox):
    with pytest.raises(checks.CheckFailed) as info:
        judged(sandbox, check, wrong)
    for fragment in fragments:
        assert re.search(fragment, str(info.value)), (fragment, str(info.value))


# ---- 4.3: one microbatch's forward and backward --------------------------------------------
def forward_step(stage, microbatch, x, target, weight):
    if not stage.is_first:
        x.requires_grad_()
    y = stage.module(x)
    if stage.is_last:
        y = stage.loss_fn(y, target) * weight
    stage.stash[microbatch] = (x, y)
    return y.detach()


def backward_step(stage, microbatch, grad):
    x, y = stage.stash.pop(microbatch)
    y.backward(grad)
    return None if stage.is_first else x.grad


def forward_step_unweighted(stage, microbatch, x, target, weight):
    return forward_step(stage, microbatch, x, target, 1.0)


def forward_step_no_requires_grad(stage, microbatch, x, target, weight):
    y = stage.module(x)
    if stage.is_last:
        y = stage.loss_fn(y, target) * weight
    stage.stash[microbatch] = (x, y)
    return y.detach()


def backward_step_keeps_activations(stage, microbatch, grad):
    x, y = stage.stash[microbatch]  # never freed: every microbatch stays in flight
    y.backward(grad)
    return None if stage.is_first else x.grad


def test_stage_step_solution_passes(capsys):
    lab04.check_stage_steps(forward_step, backward_step)
    assert "✓ Exercise 4.3 passed" in capsys.readouterr().out


@pytest.mark.parametrize("fwd,bwd,fragment", [
    (forward_step_unweighted, backward_step, "about m=2: scale each microbatch's loss"),
    (forward_step_no_requires_grad, backward_step, "did the forward make the received "
                                                   "activation require grad"),
    (forward_step, backward_step_keeps_activations, "still holds the activations of "
                                                    "microbatches"),
])
def test_wrong_stage_steps_fail_with_a_hint(fwd, bwd, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab04.check_stage_steps, fwd, bwd, world_sizes=(2,))


# ---- 4.4: the partitioner ---------------------------------------------------------------------
def partition(costs, p):
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = {(0, 0): (0, None)}
    for k in range(1, p + 1):
        for j in range(k, n + 1):
            options = [(max(best[(k - 1, i)][0], prefix[j] - prefix[i]), i)
                       for i in range(k - 1, j) if (k - 1, i) in best]
            best[(k, j)] = min(options)
    ranges, j = [], n
    for k in range(p, 0, -1):
        i = best[(k, j)][1]
        ranges.append(range(i, j))
        j = i
    return ranges[::-1]


def partition_greedy(costs, p):
    """Fill each stage up to the average: often right, not always."""
    target = sum(costs) / p
    ranges, start, acc = [], 0, 0
    for i, c in enumerate(costs):
        acc += c
        left_layers, left_stages = len(costs) - i - 1, p - len(ranges) - 1
        if (acc >= target and left_stages > 0) or left_layers == left_stages > 0:
            ranges.append(range(start, i + 1))
            start, acc = i + 1, 0
    ranges.append(range(start, len(costs)))
    return ranges


def partition_by_count(costs, p):
    n = len(costs)
    return [range(s * n // p, (s + 1) * n // p) for s in range(p)]


def partition_tuples(costs, p):
    return [(r.start, r.stop) for r in partition(costs, p)]


def test_partition_solution_passes(capsys):
    lab04.check_partition(partition)
    assert "✓ Exercise 4.4 passed" in capsys.readouterr().out
    lab04.check_partition(partition, **lab04.check_partition.hidden(random.Random(5)))


@pytest.mark.parametrize("wrong,fragment", [
    (partition_greedy, "a better cut is"),
    (partition_by_count, "a better cut is"),
    (partition_tuples, "expected a range\\(start, end\\)"),
])
def test_wrong_partitions_fail(wrong, fragment, sandbox):
    with pytest.raises(checks.CheckFailed, match=fragment):
        judged(sandbox, lab04.check_partition, wrong)


def test_stubs_say_not_implemented(sandbox):
    def stub(*args):
        raise NotImplementedError

    for check, ex in ((lab04.check_gpipe, "4.1"), (lab04.check_one_f_one_b, "4.2"),
                      (lab04.check_partition, "4.4")):
        with pytest.raises(NotImplementedError, match=f"Exercise {ex} is not implemented"):
            check(stub)
    with pytest.raises(NotImplementedError, match="Exercise 4.3 is not implemented"):
        judged(sandbox, lab04.check_stage_steps, stub, stub, world_sizes=(2,))
