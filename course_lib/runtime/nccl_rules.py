"""gloo that keeps NCCL's rules: what a GPU cluster would refuse, refused on a laptop.

NCCL is stricter than gloo in ways a CPU run never shows: code that passes every
test here can hang or corrupt data on its first GPU run. With
``COURSE_LIB_NCCL_RULES=1`` in the environment (or ``run(..., nccl_rules=True)``)
every rank of a gloo job refuses, with :class:`NcclRuleError` naming the rule
and the call, what NCCL forbids and gloo forgives:

1. **No tags.** NCCL has none: it matches the messages between two ranks in the
   order they were posted, and a tag is ignored. A message given a tag other than 0
   is refused at once, naming the call: code that works only because of its tags
   would swap its messages there without a word.
2. **One issuing thread at a time.** A thread may issue an operation (any
   collective or message, on any group) only when every operation another thread
   issued has completed. NCCL needs the operations of a communicator in the same
   order on every rank, and ranks that launch the kernels of different
   communicators in different orders can deadlock: two threads issuing at once
   have no order.
3. **The same collectives, in the same order, with the same shapes, on every
   rank of a group**: before its n-th collective on a group, a rank posts what it
   calls (name, shape, dtype) in the job's store and reads the others' n-th; a
   difference names both calls. (Not torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``:
   on gloo it counts point-to-point messages in the same sequence as collectives,
   so ranks that sent different numbers of messages "mismatch", and torch's DDP
   crashes under it.) A rank that never comes leaves the others waiting there, as
   NCCL would: the job's timeout reports the stacks.
4. **No future from a coalesced message**: NCCL's ``batch_isend_irecv`` returns
   works without one. Its works refuse ``get_future()``, and course_lib's
   ``comm.exchange`` takes NCCL's path (``batch_isend_irecv``) on gloo too.
5. **Groups destroyed in the same order on every rank** (NCCL's teardown of a
   communicator can wait for its peers): checked after each call of a job.
6. **No CPU tensor in a collective of a job on GPUs** (a no-op on CPU jobs).

Jobs under the rules start each rank in a new interpreter, as NCCL jobs do, so
that what depends on memory addresses (the order of a ``set`` of groups) varies
from rank to rank as it would on a cluster.
"""
from __future__ import annotations

import functools
import inspect
import os
import threading
import types

import torch
import torch.distributed as dist

ENV = "COURSE_LIB_NCCL_RULES"
P2P = ("send", "recv", "isend", "irecv")
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
               "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier", "gather",
               "scatter", "all_gather_object", "broadcast_object_list")
_installed = False
_lock = threading.Lock()
_in_flight: dict = {}  # thread id -> [(what, work or None: a blocking call running)]
destroyed: list = []  # names of the groups destroyed on this rank, in order
_issued: dict = {}  # group name -> collectives this rank issued on it in this call
_call = [0]  # the number of the job's call being served (warm ranks serve many)
# collectives whose tensors may differ in shape from rank to rank
_UNEVEN = ("all_to_all", "all_to_all_single", "all_gather_object", "broadcast_object_list",
           "gather_object", "scatter_object_list")


class NcclRuleError(Exception):
    """Code that gloo runs and NCCL would not. (Not a RuntimeError: code that catches
    torch's errors to fall back must not swallow this one.)"""


def requested():
    """Whether this process asks for the rules (``COURSE_LIB_NCCL_RULES``)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def active():
    """Whether the rules are enforced in this process (a rank that installed them)."""
    return _installed


def _name(group):
    if group is None or group is dist.GroupMember.WORLD:
        return "the world"
    return f"group {dist.distributed_c10d._world.pg_names.get(group, '?')}"


def _thread_name(ident):
    return next((t.name for t in threading.enumerate() if t.ident == ident), f"thread {ident}")


def _check_thread(what):
    """Rule 2: no other thread may have an operation in flight."""
    me = threading.get_ident()
    with _lock:
        for ident, ops in list(_in_flight.items()):
            if ident == me:
                continue
            ops[:] = [(op, work) for op, work in ops if work is None or not work.is_completed()]
            if ops:
                raise NcclRuleError(
                    f"NCCL rule (one issuing thread at a time): {_thread_name(me)} issues "
                    f"{what} while {_thread_name(ident)} has {ops[0][0]} in flight. On NCCL "
                    f"the ranks could issue the two in different orders and deadlock: issue "
                    f"every operation of a rank from one thread (course_lib runs its "
                    f"asynchronous ones on the rank's helper thread, in order).")


def _track(what, call):
    """Run a distributed call under rules 2 and 6; remember an asynchronous work."""
    _check_thread(what)
    me = threading.get_ident()
    entry = [what, None]
    with _lock:
        _in_flight.setdefault(me, []).append(entry)
    try:
        work = call()
    finally:
        with _lock:
            ops = _in_flight.get(me, [])
            if entry in ops:
                ops.remove(entry)
    if work is not None and hasattr(work, "is_completed"):
        with _lock:
            _in_flight.setdefault(me, []).append((what, work))
    return work


def _no_cpu_tensors(what, args):
    """Rule 6: on a GPU job, the tensors of a collective live on the GPU."""
    from course_lib.runtime.backend import current_device

    if current_device().type != "cuda":
        return
    for value in args:
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            raise NcclRuleError(f"NCCL rule (GPU tensors): {what} got a CPU tensor; NCCL "
                                f"moves only tensors on the rank's GPU")


class CoalescedWork:
    """A work of ``batch_isend_irecv`` as NCCL gives it: waitable, no future (rule 4)."""

    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs):
        return self._work.wait(*args, **kwargs)

    def is_completed(self):
        return self._work.is_completed()

    def get_future(self):
        raise NcclRuleError("NCCL rule (coalesced works): a work of batch_isend_irecv has no "
                            "future on NCCL; wait on the work itself")


def _no_tag(call, tag):
    """Rule 1: a tag would be ignored by NCCL, so a message that relies on one is refused."""
    if tag:
        raise NcclRuleError(
            f"NCCL rule (no tags): {call} was given tag={tag}. NCCL matches messages by "
            f"posting order, it has no tags: post the messages between two ranks in the same "
            f"order on both, and leave the tag out.")


def _p2p(original, name):
    @functools.wraps(original)
    def wrapper(tensor, *args, **kwargs):
        # (dst/src, group, tag) may come by position
        _no_tag(f"{name}()", kwargs.get("tag", args[2] if len(args) >= 3 else 0))
        _no_cpu_tensors(name, [tensor])
        return _track(f"{name}()", lambda: original(tensor, *args, **kwargs))
    return wrapper


def begin_call(number):
    """A warm rank starts serving call ``number``: collectives count from 1 again."""
    with _lock:
        _issued.clear()
        _call[0] = number


def _fingerprint(name, bound):
    """What the ranks of a group must agree on: the call, and its tensor's shape and dtype."""
    tensor = next((v for v in bound.arguments.values() if isinstance(v, torch.Tensor)), None)
    if tensor is None or name in _UNEVEN:
        return f"{name}()"
    return f"{name}() of a {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} tensor"


def _await_peers(store, keys):
    store.wait(keys)


# The wait for the other ranks' calls, as a frame named after the collective: a hang
# report reads "waits in all_reduce()" (course_lib.runtime.dumps knows this module).
_AWAIT = {name: types.FunctionType(_await_peers.__code__.replace(co_name=name),
                                   _await_peers.__globals__, name)
          for name in COLLECTIVES}


def _check_same_call(name, bound):
    """Rule 3: this rank's n-th collective on the group is the others' n-th."""
    group = bound.arguments.get("group")
    group = group if group is not None else dist.GroupMember.WORLD
    if dist.get_rank(group) < 0:  # not a member: torch returns without a collective
        return
    c10d = dist.distributed_c10d
    group_name = c10d._get_process_group_name(group)
    with _lock:
        count = _issued[group_name] = _issued.get(group_name, 0) + 1
    mine = _fingerprint(name, bound)
    store, me = c10d._get_default_store(), dist.get_rank()
    prefix = f"rules/calls/{_call[0]}/{group_name}/{count}/"
    store.set(prefix + str(me), mine)
    peers = [r for r in dist.get_process_group_ranks(group) if r != me]
    _AWAIT[name](store, [prefix + str(r) for r in peers])
    for peer in peers:
        theirs = store.get(prefix + str(peer)).decode()
        if theirs != mine:
            raise NcclRuleError(
                f"NCCL rule (the same collectives in the same order): the collective number "
                f"{count} on {_name(group)} is {mine} on rank {me} but {theirs} on rank "
                f"{peer}. NCCL would hang or mix the data up: every rank of a group must "
                f"issue the same collectives, in the same order, with the same shapes.")


def _collective(original, name):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        _no_cpu_tensors(name, list(args) + list(kwargs.values()))
        bound = signature.bind(*args, **kwargs)
        _check_thread(f"{name}()")
        _check_same_call(name, bound)
        return _track(f"{name}()", lambda: original(*args, **kwargs))
    return wrapper


def _batch(original):
    @functools.wraps(original)
    def wrapper(p2p_op_list):
        for op in p2p_op_list:
            _no_tag(f"batch_isend_irecv() ({op.op.__name__} of a P2POp)", op.tag)
        works = _track("batch_isend_irecv()", lambda: original(p2p_op_list))
        return [CoalescedWork(w) for w in works or []]
    return wrapper


def _destroy(original):
    @functools.wraps(original)
    def wrapper(group=None):
        destroyed.append(_name(group))
        return original(group)
    return wrapper


def install():
    """Enforce the rules in this process (a rank, before any user code runs)."""
    global _installed
    if _installed:
        return
    modules = (dist, dist.distributed_c10d)
    for name in (*P2P, *COLLECTIVES, "batch_isend_irecv", "destroy_process_group"):
        original = getattr(dist.distributed_c10d, name, None)
        if original is None:
            continue
        wrapped = (_p2p(original, name) if name in P2P else
                   _batch(original) if name == "batch_isend_irecv" else
                   _destroy(original) if name == "destroy_process_group" else
                   _collective(original, name))
        for module in modules:
            if getattr(module, name, None) is original:
                setattr(module, name, wrapped)
    _installed = True


def check_destroy_order(orders):
    """Rule 5 over the orders the ranks destroyed their groups in (``{rank: [name]}``):
    two ranks must destroy the groups they share in the same order."""
    ranks = sorted(orders)
    for a in ranks:
        for b in ranks:
            if a >= b:
                continue
            shared = set(orders[a]) & set(orders[b])
            mine = [g for g in orders[a] if g in shared]
            theirs = [g for g in orders[b] if g in shared]
            if mine != theirs:
                raise NcclRuleError(
                    f"NCCL rule (teardown order): rank {a} destroyed {', '.join(mine)} in "
                    f"that order, rank {b} {', '.join(theirs)}. NCCL's teardown of a "
                    f"communicator can wait for its peers: destroy groups in one order on "
                    f"every rank (by name, as torch does).")
