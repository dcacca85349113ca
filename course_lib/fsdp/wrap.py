"""Wrap policies: which submodules become FSDP units (Lab 03). Plans are data.

A policy is ``policy(module, unclaimed_params) -> bool``: should this
submodule be a unit of its own, given the number of its parameters no unit
inside it has claimed yet? :func:`plan_units` walks the model bottom-up, as
torch's auto-wrap does, and returns the plan as a dict: unit name -> names of
the parameters it holds, the root ``""`` last, holding what no unit claimed::

    plan_units(gpt, by_type(Block))
    # {"blocks.0": ["blocks.0.ln1.weight", ...], "blocks.1": [...], "": ["tok.weight", ...]}

The lecture's OLMo policies in these terms: ``by_block`` is ``by_type(Block)``;
``size_based`` is ``by_size(100_000_000)`` (torch's default threshold);
``by_block_group`` would be a policy on a module holding m blocks; ``by_block_and_size``
also makes the token embedding and the output layer units of their own (a short
custom policy). Containers (``nn.ModuleList``, ``nn.ModuleDict``) never become units:
their forward never runs, so nothing would gather them.
"""
from __future__ import annotations

import torch.nn as nn


def by_type(*module_classes):
    """Every submodule that is an instance of one of ``module_classes`` is a unit."""
    if not module_classes:
        raise ValueError("by_type needs at least one module class")

    def policy(module, unclaimed_params):
        return isinstance(module, module_classes)

    policy.__name__ = f"by_type({', '.join(c.__name__ for c in module_classes)})"
    return policy


def by_size(min_params):
    """A submodule is a unit once the parameters no smaller unit claimed reach
    ``min_params`` (torch's ``size_based_auto_wrap_policy``)."""
    if min_params <= 0:
        raise ValueError(f"min_params must be positive, got {min_params}")

    def policy(module, unclaimed_params):
        return unclaimed_params >= min_params

    policy.__name__ = f"by_size({min_params})"
    return policy


def plan_units(module, policy=None):
    """{unit name: [parameter names]} in forward-definition order, root "" last.
    Shared parameters (tied weights) belong to the first unit that claims them.
    ``policy=None``: one unit, the whole model."""
    claimed = set()
    plan = {}

    def visit(mod, prefix):
        """Claim bottom-up; returns this subtree's parameter names not yet claimed."""
        pending = []
        for name, child in mod.named_children():
            pending += visit(child, f"{prefix}{name}.")
        for name, p in mod.named_parameters(recurse=False):
            if id(p) not in claimed:
                pending.append((f"{prefix}{name}", p))
        # a container's forward never runs (its owner iterates it), so hooks on it would
        # never gather its parameters: like torch's auto-wrap, never make one a unit
        container = isinstance(mod, (nn.ModuleList, nn.ModuleDict))
        if policy is not None and prefix and pending and not container and \
                policy(mod, sum(p.numel() for _, p in _unique(pending))):
            unit = prefix[:-1]
            plan[unit] = _take(pending, claimed)
            return []
        return pending

    rest = visit(module, "")
    root = _take(rest, claimed)
    ordered = {name: plan[name] for name in sorted(plan, key=_definition_order(module))}
    ordered[""] = root
    return ordered


def _unique(named):
    seen, out = set(), []
    for name, p in named:
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _take(named, claimed):
    names = []
    for name, p in named:
        if id(p) not in claimed:
            claimed.add(id(p))
            names.append(name)
    return names


def _definition_order(module):
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    return lambda name: order.get(name, len(order))
