"""Plain data: what crosses from the student's side to the judge is data and nothing else."""
import json
import math
import re

import numpy
import pytest
import torch

from course_lib.submission import plain


def test_every_plain_kind_comes_back_equal_and_of_the_exact_type():
    value = {"f32": torch.arange(6.0).reshape(2, 3), "bf16": torch.tensor([1.5, -2.0]).bfloat16(),
             "bool": torch.tensor([True, False]), "scalar": torch.tensor(7, dtype=torch.int64),
             "empty": torch.zeros(0, 4), "strided": torch.arange(12.0).reshape(3, 4).t(),
             "param": torch.nn.Parameter(torch.ones(2)),
             3: (1, 2.5, None, True, "text"), "nested": [[{"a": 1}], ()],
             "special": [math.inf, -math.inf], "dtype": torch.float16, "numpy": numpy.int64(4),
             (1, "key"): "tuple keys", "size": torch.Size([2, 3])}
    back = plain.roundtrip(value)
    assert back.keys() == value.keys()
    for key in ("f32", "bf16", "bool", "scalar", "empty", "strided"):
        assert type(back[key]) is torch.Tensor
        assert back[key].dtype == value[key].dtype and torch.equal(back[key], value[key])
        assert back[key].is_contiguous()
    assert type(back["param"]) is torch.Tensor and not back["param"].requires_grad
    assert back[3] == (1, 2.5, None, True, "text") and type(back[3][0]) is int
    assert back["nested"] == [[{"a": 1}], ()] and back["special"] == [math.inf, -math.inf]
    assert back["dtype"] is torch.float16 and back["numpy"] == 4 and type(back["numpy"]) is int
    assert back["size"] == (2, 3) and type(back["size"]) is tuple
    assert math.isnan(plain.roundtrip(float("nan")))


class AlwaysEqual(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class Agreeable(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return True


class Named(str):
    pass


@pytest.mark.parametrize("value,fragment", [
    (AlwaysEqual(3), "a subclass of int"),
    ([1, Named("x")], "the value[1] is a test_plain.Named, a subclass of str"),
    ({"a": torch.ones(2).as_subclass(Agreeable)}, "a subclass of torch.Tensor"),
    (object(), "checks take tensors, numbers, strings"),
    (lambda: 1, "checks take tensors"),
    (torch.ones(2).to_sparse(), "dense tensor"),
    (torch.empty(2, device="meta"), "dense tensor"),
    (torch.zeros(2, dtype=torch.float8_e4m3fn), "dtype torch.float8_e4m3fn"),
    (torch.qint8, "the dtype torch.qint8"),
    (type("MyList", (list,), {})([1]), "a subclass of list"),
], ids=["int", "str", "tensor", "object", "function", "sparse", "meta", "float8", "qint8",
        "list"])
def test_anything_that_is_not_plain_data_is_refused_saying_what_and_where(value, fragment):
    with pytest.raises(plain.NotPlain, match=re.escape(fragment)):
        plain.encode(value)


def test_nesting_has_a_limit():
    deep = []
    for _ in range(plain.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(plain.NotPlain, match="nested more than"):
        plain.encode(deep)


def tensor_node(**changes):
    node = json.loads(plain.encode(torch.arange(3.0)))
    node.update(changes)
    return json.dumps(node)


@pytest.mark.parametrize("text,fragment", [
    ("not json", "not plain data"),
    (tensor_node(s=[4]), "12 bytes for 4 elements"),
    (tensor_node(**{"$x": "object"}), "unknown dtype"),
    (tensor_node(s=[-3]), "valid shape"),
    (tensor_node(b=123), "valid shape and bytes"),
    (json.dumps({"$code": "print(1)"}), "unknown node"),
    (json.dumps({"$f": "1e308"}), "not nan or inf"),
    (json.dumps({"$d": [[[1], 2]]}), "unhashable"),
    (json.dumps({"$t": "abc"}), "expected a list"),
])
def test_decoding_refuses_anything_encode_would_not_write(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        plain.decode(text)
