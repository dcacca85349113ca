"""Plain data: what a student's code may hand back to a check, and how it travels.

The grader's judge compares what the student's code computed with its own
references, in a process that never ran student code. What crosses from the
student's side must therefore be data and nothing else: an ``int`` subclass
whose ``__eq__`` always says yes, a tensor subclass that overrides
``__torch_function__``, or any object with methods of its own would let the
student's code decide the comparison. :func:`encode` accepts only

- ``None``, ``bool``, ``int``, ``float``, ``str`` (exactly those types; numpy
  scalars become Python numbers),
- lists, tuples and dicts of plain data (keys plain and hashable),
- dense tensors (``torch.Tensor`` or ``nn.Parameter`` exactly, strided, on any
  device): dtype, shape and raw bytes,
- ``torch.dtype`` (by name),

and writes JSON. :func:`decode` rebuilds the same values from that text alone:
numbers and strings from JSON, tensors from their bytes, dtype and shape
(``torch.frombuffer``), so nothing on the judge's side is an object the
student's code built::

    text = encode({"out": torch.arange(3.0), "messages": 2})
    decode(text)      # {'out': tensor([0., 1., 2.]), 'messages': 2}

A check cell in a notebook sends its results through the same round trip
(:func:`roundtrip`), so the kernel's feedback and the gradebook's verdict are
computed from the same values.
"""
from __future__ import annotations

import base64
import json
import math

import numpy
import torch

# dtypes that may travel; anything else is refused on both sides
DTYPES = {str(dt).removeprefix("torch."): dt for dt in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}
MAX_DEPTH = 32
MAX_BYTES = 1 << 30  # what one answer may hold in all: far more than any check needs


class NotPlain(TypeError):
    """A value that is not plain data (the message says where in the value, and what)."""


def encode(value):
    """``value`` as JSON text (raises :class:`NotPlain` for anything but plain data)."""
    budget = [MAX_BYTES]
    return json.dumps(_encode(value, "the value", 0, budget), allow_nan=False,
                      separators=(",", ":"))


def _encode(value, where, depth, budget):
    if depth > MAX_DEPTH:
        raise NotPlain(f"{where} is nested more than {MAX_DEPTH} deep")
    kind = type(value)
    if value is None or kind in (bool, str, int):
        if kind is str:
            _spend(budget, len(value), where)
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$f": repr(value)}
    if kind.__module__ == "numpy" and isinstance(value, numpy.generic):  # numpy's own scalars
        return _encode(value.item(), where, depth, budget)
    if kind is list:
        return [_encode(v, f"{where}[{i}]", depth + 1, budget) for i, v in enumerate(value)]
    if kind is tuple:
        return {"$t": [_encode(v, f"{where}[{i}]", depth + 1, budget)
                       for i, v in enumerate(value)]}
    if kind is torch.Size:
        return {"$t": [int(v) for v in value]}
    if kind is dict:
        return {"$d": [[_encode(k, f"a key of {where}", depth + 1, budget),
                        _encode(v, f"{where}[{k!r}]", depth + 1, budget)]
                       for k, v in value.items()]}
    if kind in (torch.Tensor, torch.nn.Parameter):
        return _encode_tensor(value, where, budget)
    if kind is torch.dtype:
        name = str(value).removeprefix("torch.")
        if name not in DTYPES:
            raise NotPlain(f"{where} is the dtype {value}, which checks do not take")
        return {"$dt": name}
    shown = f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(value, torch.Tensor):
        raise NotPlain(f"{where} is a {shown}, a subclass of torch.Tensor: return a plain tensor "
                       f"(e.g. t.detach().clone() of a regular tensor)")
    if isinstance(value, (int, float, str, list, tuple, dict)):
        raise NotPlain(f"{where} is a {shown}, a subclass of {kind.__mro__[1].__name__}: return "
                       f"the plain value")
    raise NotPlain(f"{where} is a {shown}; checks take tensors, numbers, strings, and "
                   f"lists, tuples and dicts of them")


def _spend(budget, nbytes, where):
    budget[0] -= nbytes
    if budget[0] < 0:
        raise NotPlain(f"{where}: the value holds more than {MAX_BYTES} bytes in all")


def _encode_tensor(tensor, where, budget):
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        raise NotPlain(f"{where} is a {tensor.layout} tensor on {tensor.device}: return a dense "
                       f"tensor with values")
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise NotPlain(f"{where} has dtype {tensor.dtype}, which checks do not take")
    flat = tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    _spend(budget, len(raw), where)
    return {"$x": name, "s": list(tensor.shape), "b": base64.b64encode(raw).decode("ascii")}


def decode(text):
    """The value :func:`encode` wrote, rebuilt from the text alone. Raises ValueError for
    text that is not what :func:`encode` writes."""
    try:
        tree = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not plain data: {exc}") from None
    return _decode(tree, 0, [MAX_BYTES])


def _decode(node, depth, budget):
    if depth > MAX_DEPTH:
        raise ValueError("plain data nested too deep")
    kind = type(node)
    if node is None or kind in (bool, int, float, str):
        return node
    if kind is list:
        return [_decode(v, depth + 1, budget) for v in node]
    if kind is not dict or len(node) not in (1, 3):
        raise ValueError(f"not plain data: a {kind.__name__} node")
    if "$t" in node:
        return tuple(_decode(v, depth + 1, budget) for v in _list(node["$t"]))
    if "$d" in node:
        out = {}
        for pair in _list(node["$d"]):
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("not plain data: a dict entry is not a pair")
            key = _decode(pair[0], depth + 1, budget)
            try:
                out[key] = _decode(pair[1], depth + 1, budget)
            except TypeError:  # an unhashable key
                raise ValueError("not plain data: an unhashable dict key") from None
        return out
    if "$f" in node:
        if node["$f"] not in ("nan", "inf", "-inf"):
            raise ValueError("not plain data: a float that is not nan or inf")
        return float(node["$f"])
    if "$dt" in node:
        return _dtype(node["$dt"])
    if "$x" in node:
        return _decode_tensor(node, budget)
    raise ValueError(f"not plain data: unknown node {sorted(node)}")


def _list(value):
    if type(value) is not list:
        raise ValueError("not plain data: expected a list")
    return value


def _dtype(name):
    if type(name) is not str or name not in DTYPES:
        raise ValueError(f"not plain data: unknown dtype {name!r}")
    return DTYPES[name]


def _decode_tensor(node, budget):
    dtype = _dtype(node.get("$x"))
    shape, data = node.get("s"), node.get("b")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape) \
            or type(data) is not str:
        raise ValueError("not plain data: a tensor without a valid shape and bytes")
    raw = base64.b64decode(data.encode("ascii"), validate=True)
    budget[0] -= len(raw)
    if budget[0] < 0:
        raise ValueError("not plain data: too many bytes")
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(raw) != numel * itemsize:
        raise ValueError(f"not plain data: {len(raw)} bytes for {numel} elements of {dtype}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape).clone()


def roundtrip(value):
    """``decode(encode(value))``: what a judge would see of ``value``."""
    return decode(encode(value))
