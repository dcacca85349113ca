"""Exercise 7.6's check: a top-k router and Switch's load-balancing loss, called in the
student's process on logits the check drew, against a token-by-token loop in the checking
process (:mod:`.references`): probabilities, choices best first, gates, the loss and its
gradient on the logits (through the mean probabilities only)."""
from __future__ import annotations

import torch

from course_lib.grading import checks
from course_lib.grading.lab07 import jobs, references
from course_lib.grading.requests import here

EX_ROUTER = "Exercise 7.6"


@checks.check(EX_ROUTER, hidden=checks.reseeded)
def check_router(route, balance_loss, seed=75):
    ex = EX_ROUTER
    cases = references.router_cases(seed)
    answers = yield here(jobs.router_job, route, balance_loss, cases)
    for (logits, k), answer in zip(cases, answers):
        tokens, experts = logits.shape
        call = f"route(logits {tuple(logits.shape)}, k={k}) and balance_loss(probs, chosen)"
        got = checks.answer_value(ex, call, answer)
        if not (isinstance(got, tuple) and len(got) == 5):
            raise checks.CheckFailed(f"{ex}: route must return (probs, gates, chosen)")
        probs, gates, chosen, aux, grad = got
        want = references.expected_route(logits, k)

        def close(what, mine, expected, hint=""):
            checks.expect_close(ex, mine, expected, rank=0, world_size=1, rtol=1e-9,
                                atol=1e-12, what=f"{what} of {call}", hint=hint)

        close("probs", probs, want[0], hint=_probs_mistake(probs))
        if not (isinstance(chosen, torch.Tensor) and chosen.shape == want[2].shape
                and torch.equal(chosen.long(), want[2])):
            raise checks.CheckFailed(
                f"{ex}: {call}: chosen is {_show(chosen)}, expected {want[2].tolist()}.\n"
                f"Hint: each token's k experts by falling probability, best first (the order "
                f"of torch.topk), as a long tensor (T, k)")
        close("gates", gates, want[1], hint=_gates_mistake(gates, want[1]))
        aux_hint = _aux_mistake(aux, probs, chosen, experts)
        close("the balancing loss", aux, want[3].reshape(()) if isinstance(aux, torch.Tensor)
              and aux.dim() == 0 else want[3], hint=aux_hint)
        if grad is None:
            raise checks.CheckFailed(
                f"{ex}: {call}: the balancing loss has no gradient on the logits: compute "
                f"P_e from the probabilities route returned, not from detached values")
        close("the gradient of the balancing loss on the logits", grad, want[4],
              hint="the gradient flows through P_e (the mean probabilities) only: f_e is a "
                   "count of first choices, built from chosen, with no gradient")
    return (f"{len(cases)} routers (1 to 3 of 3 to 8 experts, a skewed one): probabilities, "
            f"choices best first, gates, the loss and its gradient, token by token")


def _show(value):
    return value.tolist() if isinstance(value, torch.Tensor) else repr(value)


def _probs_mistake(probs):
    if isinstance(probs, torch.Tensor) and probs.dim() == 2:
        if torch.allclose(probs.sum(0), torch.ones_like(probs.sum(0))):
            return "softmax over the experts (the last dimension), not over the tokens"
    return "each token's probabilities: softmax of its logits over the experts"


def _gates_mistake(gates, want):
    if isinstance(gates, torch.Tensor) and gates.shape == want.shape and torch.allclose(
            gates, want / want.sum(-1, keepdim=True)):
        return ("these are renormalised over the k chosen; in this course's layer (and in "
                "Switch) the gates are the router's probabilities themselves")
    return "gates[t, j] is token t's probability of its j-th chosen expert"


def _aux_mistake(aux, probs, chosen, experts):
    """Which common variant of the loss ``aux`` is, if any."""
    if not (isinstance(aux, torch.Tensor) and isinstance(chosen, torch.Tensor)
            and isinstance(probs, torch.Tensor) and chosen.dim() == 2):
        return "aux = E * sum_e f_e P_e, a scalar tensor"
    every = torch.bincount(chosen.reshape(-1).long(), minlength=experts).double()
    variant = experts * (every / every.sum() * probs.detach().double().mean(0)).sum()
    if torch.allclose(aux.detach().double(), variant) and chosen.shape[1] > 1:
        return ("f_e counts every choice here; it is the share of tokens whose *first* "
                "choice is e (chosen[:, 0])")
    return ("aux = E * sum_e f_e P_e: f_e the share of tokens whose first choice is e, P_e "
            "the mean over the tokens of their probability of e")
