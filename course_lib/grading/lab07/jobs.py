"""What runs on the student's ranks for Lab 07's checks: the student's code, and a
report (values, traffic, floating-point operations) as plain data. Nothing here works
out what the answer should be: the checks do, in their own process (:mod:`.references`)."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from course_lib import comm
from course_lib.grading import wire
from course_lib.grading.lab07 import references


def _group(use_pair):
    """The world, or ranks {1, 2} of 3 as one group and rank 0 alone (every rank makes
    both): group-local ranks that are not the global ones."""
    if not use_pair:
        return None
    alone, pair = dist.new_group([0]), dist.new_group([1, 2])
    return pair if dist.get_rank() > 0 else alone


_MATMULS = {"mm", "bmm", "matmul", "addmm", "baddbmm", "einsum"}


class _Timeline(TorchDispatchMode):
    """Records, in order, each matrix product the student's code runs ("compute")."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _MATMULS:
            self.events.append(("compute", None))
        return func(*args, **(kwargs or {}))


@contextmanager
def _posts_and_waits(events):
    """Records each message the student posts through course_lib.comm ("post", i) and
    the wait on its handle ("wait", i)."""
    originals = {name: getattr(comm, name) for name in ("exchange_async", "isend", "irecv")}

    def logged(original):
        def post(*args, **kwargs):
            handle = original(*args, **kwargs)
            number = sum(1 for kind, _ in events if kind == "post")
            events.append(("post", number))
            wait = handle.wait

            def waited(*a, **k):
                events.append(("wait", number))
                return wait(*a, **k)

            handle.wait = waited
            return handle
        return post

    for name, original in originals.items():
        setattr(comm, name, logged(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(comm, name, original)


def all_to_all_job(fn, use_pair, cases_by_size):
    """``cases_by_size[g]``: [(sends, width, dtype)] for a group of g ranks ->
    [(output, traffic)] of this rank's group. The output buffer starts at -1
    everywhere: rows never written stay -1."""
    group = _group(use_pair)
    rank = dist.get_rank(group)
    out = []
    for sends, width, dtype in cases_by_size[dist.get_world_size(group)]:
        inp = references.all_to_all_input(sends, rank, width, dtype)
        recv = [row[rank] for row in sends]
        shape = (sum(recv),) + ((width,) if width else ())
        output = torch.full(shape, -1, dtype=dtype)
        with wire.counting(p2p_only=True) as stats:
            fn(output, inp, recv, list(sends[rank]), group)
        out.append((output, stats.as_dict()))
    return out


def ring_forward_job(fn, use_pair):
    """This rank's chunk of q, k, v -> (output, traffic, floating-point operations,
    whether a matrix product ran between the first message's post and its wait)."""
    group = _group(use_pair)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    q, k, v = (z.chunk(n, dim=-2)[r].contiguous() for z in references.ring_qkv(n))
    events = []
    with wire.counting(p2p_only=True) as stats, FlopCounterMode(display=False) as flops, \
            _posts_and_waits(events), _Timeline(events), \
            wire.watch(stats, comm, ("exchange_async", "isend", "irecv")):
        got = fn(q, k, v, group)
    return got, stats.as_dict(), flops.get_total_flops(), _overlapped(events)


def ring_backward_job(fn, use_pair):
    """This rank's chunks of q, k, v, of the saved output and log-sum-exp and of the
    output's gradient -> (the student's (dq, dk, dv), traffic, floating-point operations)."""
    group = _group(use_pair)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    q, k, v = (z.chunk(n, dim=-2)[r].contiguous() for z in references.ring_qkv(n))
    out, lse, grad_out = (z.chunk(n, dim=-1 if z.dim() == 3 else -2)[r].contiguous()
                          for z in references.ring_saved(n))
    with wire.counting(p2p_only=True) as stats, FlopCounterMode(display=False) as flops:
        got = fn(q, k, v, out, lse, grad_out, group)
    if isinstance(got, (tuple, list)):
        got = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in got)
    return got, stats.as_dict(), flops.get_total_flops()


def _overlapped(events):
    """None: no message posted through course_lib.comm's non-blocking calls; else
    whether compute ran while the first one was in flight."""
    if ("post", 0) not in events:
        return None
    start = events.index(("post", 0))
    end = events.index(("wait", 0)) if ("wait", 0) in events else len(events)
    return any(kind == "compute" for kind, _ in events[start:end])


def ulysses_job(fn, use_pair, causal):
    """This rank's contiguous shard of q, k, v through the student's Ulysses, then
    backward from its shard of the output's gradient -> (output, [dq, dk, dv] or None
    when the output carries no gradient, traffic of forward and backward, what a call
    with heads that do not divide did: True for a ValueError, else what happened).""" 
    group = _group(use_pair)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, g = (z.chunk(n, dim=-2)[r].contiguous() for z in references.ulysses_inputs(n))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with wire.counting(p2p_only=True) as stats:
        out = fn(q, k, v, group, causal=causal)
        grads = None
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.backward(g)
            grads = [None if t.grad is None else t.grad.detach() for t in (q, k, v)]
    refused = None
    if n > 1:  # heads that do not divide among the ranks: 5 on 2 ranks, 4 on 3
        odd = q.detach()[:, :(5 if n == 2 else 4)].contiguous()
        try:
            fn(odd, odd, odd, group, causal=causal)
            refused = "returned"
        except ValueError:
            refused = True
        except Exception as exc:  # noqa: BLE001 - the student's code: say what it raised
            refused = f"{type(exc).__name__}: {exc}"[:200]
    return ((out.detach() if isinstance(out, torch.Tensor) else out), grads, stats.as_dict(),
            refused)


def router_job(route, balance_loss, cases):
    """In the student's process: for each (logits, k), ``route(logits, k)`` and
    ``balance_loss(probs, chosen)`` with the loss's gradient on the logits, as
    {"value": (probs, gates, chosen, aux, grad)} or {"raised": ..., "message": ...}."""
    answers = []
    for logits, k in cases:
        logits = logits.clone().requires_grad_()
        try:
            probs, gates, chosen = route(logits, k)
            aux = balance_loss(probs, chosen)
            grad = None
            if isinstance(aux, torch.Tensor) and aux.requires_grad:
                grad = torch.autograd.grad(aux, logits, allow_unused=True)[0]
            answers.append({"value": tuple(t.detach() if isinstance(t, torch.Tensor) else t
                                           for t in (probs, gates, chosen, aux, grad))})
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the answer, for the check to judge
            answers.append({"raised": type(exc).__name__, "message": str(exc)[:500]})
    return answers
