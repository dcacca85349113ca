"""Hidden settings for checks whose cases are torch's seeds (door 5 of issue 30).

A check that trains a model or runs a layer on seeded weights and data has, as its
settings, the seeds of ``torch.Generator(...).manual_seed(k)`` and
``torch.manual_seed(k)``, in the judge (its references) and on the student's ranks
(the job's inputs). A table of the answers for those seeds would pass it. Such a
check declares ``hidden=salt.draw``: the gradebook's judge then runs it once more
with every such seed k replaced by a mix of k and a salt drawn for the student,
the same on both sides, so the references and the job's inputs still agree and
nothing the notebook shows is the answer::

    @checks.check("Exercise 2.1", hidden=salt.draw)
    def check_average_gradients(average_gradients, world_sizes=(1, 2, 3)): ...

In the judge the salt is per thread (a check run beside another in one process);
a request carries it to the student's process and ranks (:func:`carried`), where it
holds for that request only. With no salt set, seeding is torch's own.
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import torch

KEY = "__salt__"  # the option a drawn salt travels in, from the check to the judge


def _process():
    """The salt's state in this process, kept where every copy of this module (a job
    travels by value, with its own) finds the same one: ``salt`` (a request's, where it
    runs), ``thread`` (the judge's, per thread) and whether seeding is routed here."""
    return torch.__dict__.setdefault("_course_lib_salt", {"salt": 0, "installed": False,
                                                          "thread": threading.local()})


def draw(rng):
    """The hidden setting of a check seeded through torch: a salt (never 0)."""
    return {KEY: rng.randrange(1, 2**31)}


def one_world(steps, options):
    """A salted run's world sizes: the largest the check runs (odd ones are the 3s), not
    all of them again: new seeds are what it is for, and the gradebook's time is short."""
    import inspect

    parameter = inspect.signature(steps).parameters.get("world_sizes")
    sizes = options.get("world_sizes", parameter.default if parameter else None)
    return {"world_sizes": (max(sizes),)} if sizes else {}


def current():
    state = _process()
    return getattr(state["thread"], "salt", None) or state["salt"]


def mixed(seed):
    """``seed`` under the current salt (itself when there is none)."""
    salt = current()
    return seed if not salt else (int(seed) * 1_000_003 + salt) % (2**63 - 1)


def install():
    """Route torch's seeding through the salt in this process, once (inert while the
    salt is 0)."""
    state = _process()
    if state["installed"]:
        return
    generator, manual_seed = torch.Generator, torch.manual_seed

    class SaltedGenerator(generator):
        def manual_seed(self, seed):
            return super().manual_seed(mixed(seed))

    def salted_manual_seed(seed):
        return manual_seed(mixed(seed))

    torch.Generator = SaltedGenerator
    torch.manual_seed = torch.random.manual_seed = salted_manual_seed
    state["installed"] = True


@contextmanager
def salted(salt):
    """The judge's side: seeds in this thread are mixed with ``salt`` for the block."""
    install()
    thread = _process()["thread"]
    before = getattr(thread, "salt", None)
    thread.salt = salt
    try:
        yield
    finally:
        thread.salt = before


def _under(salt, fn, *args, **kwargs):
    install()
    state = _process()
    before, state["salt"] = state["salt"], salt
    try:
        return fn(*args, **kwargs)
    finally:
        state["salt"] = before


def carry(fn):
    """``fn`` holding the current salt wherever it runs (itself without one)."""
    salt = current()
    return functools.partial(_under, salt, fn) if salt else fn


def carried(request):
    """``request`` with the current salt carried to where it runs (itself without one)."""
    from dataclasses import replace

    harness = carry(request.harness)
    return request if harness is request.harness else replace(request, harness=harness)
