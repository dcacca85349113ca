"""How a call travels to its ranks: cloudpickle, and one thing it gets wrong for torch.

A notebook's functions and classes go by value (cloudpickle). An autograd Function
whose ``backward`` carries torch's ``@once_differentiable`` does not survive that: the
decorator's wrapper takes the wrapped function's name (``functools.wraps``), so it is
shipped as code, and its globals hold torch's C module of autograd nodes, which
cloudpickle rebuilds type by type on the rank (``AccumulateGrad has no attribute
'_input_metadata'`` there). :class:`Pickler` ships such a wrapper as what it is, the
decorator applied to the function it wraps, made again on the rank::

    payload = dumps((fn, args, kwargs))    # what the launcher writes for the ranks
"""
from __future__ import annotations

import io

import cloudpickle
from torch.autograd.function import once_differentiable

# every wrapper once_differentiable makes runs this code (its name is the wrapped one's)
_ONCE_DIFFERENTIABLE = once_differentiable(lambda ctx: None).__code__


def once_differentiable_wrapper(obj):
    """Whether ``obj`` is a wrapper ``@once_differentiable`` made."""
    return getattr(obj, "__code__", None) is _ONCE_DIFFERENTIABLE


class Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj):
        if once_differentiable_wrapper(obj):
            return once_differentiable, (obj.__wrapped__,)
        return super().reducer_override(obj)


def dumps(obj):
    buffer = io.BytesIO()
    Pickler(buffer).dump(obj)
    return buffer.getvalue()
