"""Exercise 7.7's check: token dispatch (the kept assignments grouped by expert, rows per
rank) and combine (the inverse permutation, weighed by the gates), against a
loop in the checking process serving first choices first (:mod:`.references`)."""
from __future__ import annotations

import torch

from course_lib.grading import checks
from course_lib.grading.lab07 import references
from course_lib.grading.requests import call_each, here

EX_DISPATCH = "Exercise 7.7"


@checks.check(EX_DISPATCH, hidden=checks.reseeded)
def check_dispatch(dispatch, combine, seed=74):
    ex = EX_DISPATCH
    cases = references.dispatch_cases(seed)
    answers = yield here(call_each, dispatch, [((c.clone(), e, r, cap), {})
                                               for c, e, r, cap in cases])
    inputs = []
    for (chosen, experts, ranks, cap), answer in zip(cases, answers):
        call = (f"dispatch(chosen {tuple(chosen.shape)}, n_experts={experts}, "
                f"n_ranks={ranks}, capacity={cap})")
        got = checks.answer_value(ex, call, answer)
        order, counts = references.expected_dispatch(chosen, experts, ranks, cap)
        _grade_dispatch(ex, call, got, chosen, order, counts, experts, ranks, cap)
        inputs.append((chosen, order, *references.combine_inputs(chosen, order, len(inputs))))
    answers = yield here(call_each, combine, [((rows.clone(), torch.tensor(order), gates.clone(),
                                                chosen.shape[0]), {})
                                              for chosen, order, rows, gates in inputs])
    for (chosen, order, rows, gates), answer in zip(inputs, answers):
        call = f"combine(rows {tuple(rows.shape)}, order, gates {tuple(gates.shape)})"
        got = checks.answer_value(ex, call, answer)
        want = references.expected_combine(rows, order, gates, chosen.shape[0])
        hint = _combine_mistake(got, rows, order, gates, want)
        checks.expect_close(ex, got, want, rank=0, world_size=1, what=call, hint=hint)
    return f"{len(cases)} routings (top-1 to top-3, 2 to 4 ranks, tight capacities) and combine"


def _grade_dispatch(ex, call, got, chosen, order, counts, experts, ranks, cap):
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise checks.CheckFailed(f"{ex}: {call} must return (order, counts), got "
                                 f"{type(got).__name__}")
    got_order, got_counts = got
    got_order = got_order.tolist() if isinstance(got_order, torch.Tensor) else list(got_order)
    got_counts = got_counts.tolist() if isinstance(got_counts, torch.Tensor) else list(got_counts)
    flat = chosen.reshape(-1).tolist()
    if got_order != order:
        per_expert = [sum(1 for a in got_order if 0 <= a < len(flat) and flat[a] == e)
                      for e in range(experts)]
        over = [e for e in range(experts) if per_expert[e] > cap]
        token_by_token, _ = references.expected_dispatch(chosen, experts, ranks, cap,
                                                         first_choices_first=False)
        if over:
            why = (f"expert {over[0]} got {per_expert[over[0]]} assignments but its capacity "
                   f"is {cap}: keep {cap} and drop the rest")
        elif sorted(got_order) == sorted(order):
            why = ("the right assignments in the wrong order: group them by expert and, within "
                   "an expert, in increasing a (token order), not in the order capacity served "
                   "them: sort by (expert, a)")
        elif sorted(got_order) == sorted(token_by_token):
            why = ("served token by token: a token's later choice took an expert's slot ahead "
                   "of another token's earlier choice. Serve choice j of every token (in token "
                   "order) before choice j + 1 of any, as GShard's top-2 gating does")
        else:
            why = ("not the assignments that fit: expert e takes the first choices that "
                   "chose it in token order, then the second choices, and so on, up to "
                   "`capacity`")
        raise checks.CheckFailed(f"{ex}: {call}: order {got_order}, expected {order}.\n"
                                 f"Why: {why}")
    if got_counts != counts:
        why = (f"one count per rank ({ranks}), not per expert ({experts}): rank r holds "
               f"experts r*E/n .. (r+1)*E/n - 1" if len(got_counts) == experts != ranks else
               "counts[r] is the number of rows of order whose expert lives on rank r")
        raise checks.CheckFailed(f"{ex}: {call}: counts {got_counts}, expected {counts}.\n"
                                 f"Why: {why}")


def _combine_mistake(got, rows, order, gates, want):
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "combine returns one row per token: (n_tokens, d)"
    k = gates.shape[-1]
    ungated = references.expected_combine(rows, order, torch.ones_like(gates), want.shape[0])
    if torch.allclose(got, ungated):
        return "each row must be weighed by its gate, gates[t, j] for assignment a = t*k + j"
    unpermuted = _token_major(rows, order, gates, want.shape[0])
    if torch.allclose(got, unpermuted):
        return ("row i is the answer for assignment order[i], i.e. token order[i] // k: "
                "apply the inverse of the dispatch permutation (index_add on order // k)")
    return (f"row i goes back to token order[i] // k, times gates[order[i] // k, order[i] % k] "
            f"(here k = {k})")


def _token_major(rows, order, gates, n_tokens):
    """Row i added to token i // k, as if the rows were still in token order."""
    k = gates.shape[-1]
    weights = gates.reshape(-1)[torch.tensor(order, dtype=torch.long)].unsqueeze(-1)
    index = torch.arange(len(order)) // k
    return rows.new_zeros(n_tokens, rows.shape[-1]).index_add(0, index, weights * rows)
