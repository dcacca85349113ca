"""Weight versions observed: what a run of PipeDream's asynchronous 1F1B did with them.

A stage's :class:`VersionLog` keeps a digest of every version W^(k) its weights have
had (k updates made) and, for each microbatch, the version in place when its forward
ran and when its backward ran: matched against the digests, so that a stash that
restores nothing, or the wrong microbatch's version, shows as such. After every
action it also measures the stash (:func:`stash_bytes`): the bytes of the tensors it
holds, and whether any of them is a parameter itself rather than a copy.
:func:`expected_versions` is what 1F1B's order implies for a run with weight
stashing, and :func:`versions_table` prints either side by stage and microbatch.
"""
from __future__ import annotations

import collections
import hashlib
import types

import torch
import torch.nn as nn

from course_lib.pipeline.schedules import one_f_one_b
from course_lib.pipeline.simulate import weight_versions


def stash_bytes(stash, module):
    """(bytes of the tensors ``stash`` holds, whether any of them shares its storage
    with a parameter of ``module``), reaching them through attributes, dicts, lists,
    tuples and sets; a module found there is not counted (it is the stage's own)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen, storages, total, aliased = set(), set(), 0, False
    todo = [stash]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (nn.Module, type, types.ModuleType,
                                               types.FunctionType, types.MethodType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() in params:
                aliased = True
            elif storage.nbytes() and storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            todo += list(obj)
        elif hasattr(obj, "__dict__"):
            todo += list(vars(obj).values())
    return total, aliased


class VersionLog:
    """Which weight version each action of one stage ran on. ``versions[i]`` is
    microbatch i's [forward, backward, updates, restored]: the version in place for
    its forward and for its backward (None: no version the stage has had), the
    updates made before its backward, and whether the newest weights were back in
    place once the backward was over. ``held[k]`` is the bytes the stash held after
    the stage's k-th action, ``version_bytes`` the bytes of one version."""

    def __init__(self, module):
        self.module = module
        self.history = [self._digest()]  # history[k]: a digest of W^(k)
        self.versions, self.held, self.losses, self.aliased = {}, [], {}, False
        self.version_bytes = sum(p.numel() * p.element_size() for p in module.parameters())

    def _digest(self):
        digest = hashlib.blake2b(digest_size=16)
        for p in self.module.parameters():
            digest.update(p.detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
        return digest.digest()

    def in_place(self):
        """The version the module holds now (the newest if two are equal), or None."""
        digest = self._digest()
        return next((k for k in range(len(self.history) - 1, -1, -1)
                     if self.history[k] == digest), None)

    def forwarded(self, i, stash):
        """After the stash saved microbatch i's version, before its forward runs."""
        self.versions[i] = [self.in_place(), None, None, None]
        self._held(stash)

    def backward_starts(self, i):
        """Inside the stash's restore, before microbatch i's backward runs."""
        self.versions[i][1] = self.in_place()

    def backward_ended(self, i, stash):
        """After the restore is over and the stash dropped microbatch i's version."""
        newest = len(self.history) - 1
        self.versions[i][2:] = [newest, self.in_place() == newest]
        self._held(stash)

    def updated(self):
        self.history.append(self._digest())

    def _held(self, stash):
        held, aliased = stash_bytes(stash, self.module)
        self.held.append(held)
        self.aliased |= aliased

    def as_dict(self):
        """The log as plain data, microbatches in order."""
        return {"versions": [self.versions[i] for i in sorted(self.versions)],
                "held": list(self.held), "version_bytes": self.version_bytes,
                "aliased": self.aliased, "losses": [self.losses[i] for i in sorted(self.losses)]}


def expected_versions(p, m):
    """Per stage, what a run with weight stashing logs for each microbatch
    ([forward, backward, updates, restored]): the backward on the forward's version."""
    return [[[f, f, c, True] for _, (f, c) in sorted(row.items())]
            for row in weight_versions(one_f_one_b(p, m))]


def versions_table(versions):
    """``versions[s]`` (a stage's log, as :meth:`VersionLog.as_dict` gives it) as text:
    per stage, the version each microbatch's forward and backward ran on, and the
    staleness, the updates made between its forward and its backward."""
    def cells(values):  # "?": a version that matched none the stage has had
        return " ".join(f"{'?' if v is None else v:>3}" for v in values)

    lines = [f"{'microbatch':>22} " + cells(range(max(len(row) for row in versions)))]
    for s, row in enumerate(versions):
        lines += [f"{f'stage {s}':<8}{'forward on':>14} " + cells(r[0] for r in row),
                  f"{'backward on':>22} " + cells(r[1] for r in row),
                  f"{'staleness':>22} " + cells(None if r[0] is None else r[2] - r[0]
                                                for r in row)]
    return "\n".join(lines)
