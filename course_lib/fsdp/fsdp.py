"""FSDP from scratch: units of flat, sharded parameters gathered just in time (Lab 03).

``FSDP(model, units=by_type(Block))`` turns each unit (and the root, which
holds what no unit claimed) into flat parameters sharded over the group
(:mod:`course_lib.fsdp.flat_param`). Around each unit's forward:

    pre-forward   all-gather the unit's full parameters (wait for a prefetch)
                  and prefetch the next ``prefetch`` units' all-gathers
    post-forward  "full": free them again; a hook on the outputs waits for backward
    pre-backward  "full": all-gather them again (prefetching the units before it)
    post-backward reduce-scatter the unit's gradient into its shard's .grad,
                  free the full parameters

so at any time only the units computing (plus the prefetched ones) are whole:
peak parameter memory sum(psi_i)/n + (prefetch + 1) max(psi_i), plus psi_root:
the root stays whole from its forward to its backward (as FSDP2's root does:
its output layer is the last thing forward uses and the first backward needs,
and the root holds no block). Per step a rank
moves 3 psi (n-1)/n bytes (two all-gathers, one reduce-scatter) against DDP's
2 psi (n-1)/n. ``sharding``: "full" (FULL_SHARD), "grad_op" (SHARD_GRAD_OP:
keep the full parameters from forward to the unit's backward), "none"
(NO_SHARD: whole copies, gradients all-reduced as DDP), "hybrid" (HYBRID_SHARD:
a 2-D ``mesh`` with dims ("replicate", "shard"); full sharding inside a shard
group, gradient shards all-reduced across the replicate group)::

    model = FSDP(GPT(cfg), units=by_type(Block))
    opt = torch.optim.AdamW(model.parameters())     # the local shards
    loss = model(x).loss(...); loss.backward(); opt.step()
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from course_lib import trace
from course_lib.collectives.select import collective_ops
from course_lib.fsdp.flat_param import FlatParam
from course_lib.fsdp.wrap import plan_units

SHARDINGS = ("full", "grad_op", "none", "hybrid")


def collectives_for(kind):
    """The three collectives FSDP needs, counted by ``comm.counting()``: torch's
    ("torch") or Lab 01's ring ("ring", built on counted send/recv)."""
    return collective_ops(kind)


class _Unit:
    """One unit: its module, its flat parameters, and where it is in a step."""

    def __init__(self, name, module, flats):
        self.name, self.module, self.flats = name, module, flats
        self.label = name or "root"
        self.backward_ready = False  # its pre-backward ran in this backward
        self.started = None  # tracer stamp: start of its forward or backward

    def unshard(self, async_op=False):
        for flat in self.flats:
            flat.unshard(async_op=async_op)

    def wait(self):
        for flat in self.flats:
            flat.wait()

    def reshard(self):
        for flat in self.flats:
            flat.reshard()

    @property
    def unsharded(self):
        return any(flat.unsharded for flat in self.flats)


class FSDP(nn.Module):
    """Fully sharded data parallelism over ``group`` (the world by default)."""

    def __init__(self, module, *, units=None, sharding="full", group=None, mesh=None,
                 prefetch=1, collectives="torch", prefetch_plan=None):
        super().__init__()
        if sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
        if (sharding == "hybrid") != (mesh is not None):
            raise ValueError("sharding='hybrid' takes a 2-D mesh with dims ('replicate', "
                             "'shard'), and only it does")
        self.module, self.sharding, self.prefetch = module, sharding, prefetch
        self.prefetch_plan = prefetch_plan or prefetch_targets
        group = group if group is not None else dist.group.WORLD  # None below: a group of one
        if sharding == "hybrid":
            shard_group, replicate_group = mesh.get_group("shard"), mesh.get_group("replicate")
            everyone = dist.group.WORLD  # the mesh spans the world
        elif sharding == "none":
            shard_group, replicate_group, everyone = None, group, group
        else:
            shard_group, replicate_group, everyone = group, None, group
        self.replicas = dist.get_world_size(everyone)
        with torch.no_grad():  # every replica starts from rank 0's weights, as DDP
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.device.type != "meta":  # meta: no values yet (checkpoint.meta_init)
                    dist.broadcast(tensor.data, group=everyone, group_src=0)
        self.plan = plan_units(module, units)
        ops = collectives_for(collectives)
        owners, params = _owners(module)
        self.units = []
        for unit_name, names in self.plan.items():
            groups = {}
            for name in names:
                p = params[name]
                groups.setdefault((p.dtype, p.requires_grad), []).append((owners[id(p)], name, p))
            label = unit_name or "root"
            flats = [FlatParam(entries, shard_group, replicate_group, ops,
                               label=label if trainable else f"{label} (frozen)")
                     for (_, trainable), entries in groups.items()]
            if flats:
                self.units.append(_Unit(unit_name, module.get_submodule(unit_name), flats))
        self.shards = nn.ParameterList([f.shard for u in self.units for f in u.flats])
        self.forward_order = []  # units in the order their forward ran (first step)
        self._order_known = False
        self._hooks = []
        for unit in self.units:
            if unit.name:  # the root is handled by FSDP.forward itself
                self._hooks.append(unit.module.register_forward_pre_hook(
                    lambda mod, args, unit=unit: self._pre_forward(unit)))
                self._hooks.append(unit.module.register_forward_hook(
                    lambda mod, args, out, unit=unit: self._post_forward(unit, out)))
            for flat in unit.flats:
                if flat.requires_grad:
                    # on every ``full`` the flat allocates (its first unshard, here)
                    flat.on_grad = lambda _, unit=unit, flat=flat: self._post_backward(unit, flat)
                    flat.unshard()
                    flat.reshard()
        self._root = next(u for u in self.units if u.name == "") if self.plan[""] else None
        self._in_backward = False

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._root is not None:
            self._pre_forward(self._root)
        out = self.module(*args, **kwargs)
        if self._root is not None:
            self._post_forward(self._root, out)  # the root stays whole until backward
        if self.forward_order:
            self._order_known = True
        return out

    def _pre_forward(self, unit):
        if not self._order_known:
            self.forward_order.append(unit)
        unit.unshard(async_op=True)
        self._prefetch(self.forward_order, unit, backward=False)
        unit.wait()
        unit.backward_ready = False
        # the root's forward and backward enclose every unit's: no span of its own
        unit.started = _stamp() if unit is not self._root else None

    def _post_forward(self, unit, out):
        _record(f"forward {unit.label}", unit.started)
        if self.sharding in ("full", "hybrid") and unit is not self._root:
            unit.reshard()
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(out)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(lambda grad, unit=unit: self._pre_backward(unit, grad))
        return out

    def _prefetch(self, order, unit, backward):
        """Start the all-gathers of the units ``prefetch_plan`` names for ``unit``."""
        if not self.prefetch or unit not in order:
            return
        by_name = {u.name: u for u in order}
        for name in self.prefetch_plan([u.name for u in order], unit.name, self.prefetch,
                                       backward):
            if name not in by_name:
                raise ValueError(f"prefetch_plan named unit {name!r}, which is not one of "
                                 f"{list(by_name)}")
            by_name[name].unshard(async_op=True)

    # ---- backward ---------------------------------------------------------------------------
    def _pre_backward(self, unit, grad):
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if not unit.backward_ready:
            unit.backward_ready = True
            unit.unshard(async_op=True)
            self._prefetch(self.forward_order, unit, backward=True)
            unit.wait()
            unit.started = _stamp() if unit is not self._root else None
        return grad

    def _post_backward(self, unit, flat):
        _record(f"backward {unit.label}", unit.started)
        flat.reduce_grad(self.replicas)
        flat.done = True
        if all(getattr(f, "done", False) or not f.requires_grad for f in unit.flats):
            unit.reshard()

    def _end_of_backward(self):
        """Units whose gradients never arrived still reduce (zeros), so that every
        rank issues the same collectives; then every unit is sharded again."""
        for unit in self.units:
            for flat in unit.flats:
                if flat.requires_grad and not getattr(flat, "done", False):
                    flat.reduce_grad(self.replicas)
                flat.done = False
            unit.reshard()  # every mode: the next forward gathers the updated shards
            unit.backward_ready = False
        self._in_backward = False

    # ---- state -------------------------------------------------------------------------------
    def full_state_dict(self):
        """The unsharded state dict under the original names, on every rank."""
        state = {}
        for unit in self.units:
            for flat in unit.flats:
                state.update(flat.full_tensors())
        for name, buffer in self.module.named_buffers():
            state[name] = buffer.detach().clone()
        return state

    def unsharded_units(self):
        """Names of the units whose full parameters are in memory now."""
        return [u.name for u in self.units if u.unsharded]


def prefetch_targets(order, current, depth, backward=False):
    """The units whose all-gather to start while unit ``current`` computes: the
    ``depth`` units that compute next. ``order`` is the forward order (names);
    forward runs it left to right, backward right to left, so in backward the
    next units are the ones *before* ``current``, nearest first::

        prefetch_targets(["a", "b", "c", "d"], "b", 2)                  # ["c", "d"]
        prefetch_targets(["a", "b", "c", "d"], "c", 2, backward=True)   # ["b", "a"]
    """
    at = order.index(current)
    if backward:
        return order[max(0, at - depth):at][::-1]
    return order[at + 1:at + 1 + depth]


def _stamp():
    tracer = trace.get_tracer()
    return tracer.stamp() if tracer is not None else None


def _record(name, start):
    """A compute span from ``start`` to now, when a tracer records."""
    tracer = trace.get_tracer()
    if tracer is not None and start is not None:
        tracer.record(name, "compute", start, tracer.stamp())


def _owners(module):
    """({id(parameter): [(module, attribute), ...]}, {full name: parameter}): every
    place a parameter is held (several for tied weights), and every name."""
    owners, params = {}, {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None:
                if (mod, attr) not in owners.setdefault(id(p), []):
                    owners[id(p)].append((mod, attr))
                params[f"{mod_name}.{attr}" if mod_name else attr] = p
    return owners, params
