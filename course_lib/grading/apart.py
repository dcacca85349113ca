"""Keeping an answer the judge sends away from every item it answers, until that item is
decided.

A check's request may carry library answers by value (:mod:`.shipping`): Exercise
2.4's trains the library's DDP, and with it Bucket, the answer to 2.6. The student's
code runs beside it, and a warm rank outlives the request: code that put ``type(x)``
on some module there could find it again when 2.6 is graded on the same rank. So the
judge keeps account:

- a request that carries an answer to an item not yet decided never runs in the
  student's own process (which lives as long as the notebook): it runs on ranks, one
  where it would have run in the process;
- once the item whose request it was is decided, the judge ends every rank of the
  sandbox (:meth:`.Sandbox.end_ranks`): the student's cells, which may start jobs of
  their own on the same warm ranks, never run while a rank holds an undecided answer.

Not covered: the student's function called in their own process by a later request of
the same item (none of today's checks sends such a request after one that carries an
answer), and an item's own answer carried by its own requests (3.6, 3.7, 4.3, 5.4,
8.4, 8.5: within the student's reach only through code the integrity scan flags).

An answer to an item already decided may stay where it went: it can credit nothing.

Where the lab hands an item another item's answer (:data:`.hiding.GIVEN`: 2.3's frame
is built on Bucket), that item's requests run on ranks with the piece put back there,
by value, in place of its stand-in; the same account then covers the piece.
"""
from __future__ import annotations

import functools
import importlib
import sys
import types
from dataclasses import replace

from course_lib.grading.hiding import GIVEN
from course_lib.grading.shipping import _functions_of, answers_carried


class Account:
    """Which items of a lab (``items``) not yet decided have answers on the sandbox's
    ranks; ``end_ranks()`` ends every rank of the sandbox."""

    def __init__(self, items, end_ranks):
        self.items, self.end_ranks = tuple(items), end_ranks
        self.decided, self.held = set(), set()

    def route(self, exercise, request, here_timeout=120.0):
        """``(request, unwrap)``: ``request`` as it runs for ``exercise`` (moved to one
        rank when it must not run in the student's process: ``unwrap`` then says to take
        rank 0's answer)."""
        request, unwrap = given(exercise, request, here_timeout)
        held = answers_carried(request, self.items) - self.decided - {exercise}
        if held and request.kind == "here":
            request, unwrap = _on_one_rank(request, here_timeout), True
        self.held |= held
        return request, unwrap

    def decide(self, exercise):
        """``exercise`` is decided; the student's cells run next, and a cell's own ``run``
        could fetch an answer from a warm rank (it brings back what a rank returns, by
        value): nothing stays held."""
        self.decided.add(exercise)
        self.settle()

    def settle(self):
        if self.held:
            self.end_ranks()
            self.held.clear()


def given(exercise, request, here_timeout=120.0):
    """``(request, unwrap)``: for an item the lab hands another item's answer, ``request``
    on ranks with that answer put back there; for every other item, ``request`` itself."""
    entries = GIVEN.get(exercise)
    if not entries:
        return request, False
    pieces = {entry: _named(entry) for entry in entries}
    request = replace(request, harness=functools.partial(_with_given, pieces, request.harness))
    if request.kind == "here":
        return _on_one_rank(request, here_timeout), True
    return request, False


def _on_one_rank(request, timeout):
    return replace(request, kind="ranks", nproc=1, timeout=timeout)


def _named(entry):
    """The object a ``"module:name"`` entry names in this process (None if it has none)."""
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name, None)


def _namespaces(objects):
    """The global namespaces the student's ``objects`` run in (functions, classes,
    partials, and containers of them)."""
    found, todo, seen = {}, list(objects), set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            todo += [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, (list, tuple)):
            todo += list(obj)
        elif isinstance(obj, dict):
            todo += list(obj.values())
        elif isinstance(obj, type) and not obj.__module__.startswith(("torch", "course_lib")):
            todo += list(_functions_of(obj)) + list(obj.__bases__)
        elif isinstance(obj, types.FunctionType):
            found[id(obj.__globals__)] = obj.__globals__
    return list(found.values())


def _with_given(pieces, harness, *args, **kwargs):
    """On each rank of the request: each given piece in place of its stand-in, in the
    library's modules and in the student's namespace; then the harness."""
    for entry, piece in pieces.items():
        stand_in = _named(entry)  # here, the sandbox's: the stand-in
        if stand_in is None or stand_in is piece:
            continue
        spaces = [vars(m) for n, m in list(sys.modules.items())
                  if n.startswith("course_lib") and m is not None]
        for space in spaces + _namespaces([*args, *kwargs.values()]):
            for key, value in list(space.items()):
                if value is stand_in:
                    space[key] = piece
    return harness(*args, **kwargs)
