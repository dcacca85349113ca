"""The activation memory of attention: what autograd keeps from forward to backward
(Lab 07, Prediction 7.1).

A layer's activations are the tensors its forward saves for its backward; they live
until the backward runs, one set per layer, so with L layers they are what grows with
the sequence. :func:`saved_bytes` measures them: it runs a function under
``torch.autograd.graph.saved_tensors_hooks`` and adds up the bytes of the distinct
storages handed to the hook (a tensor saved twice, or two views of one storage, count
once), leaving out the parameters' storages, which the model holds anyway.

For one attention layer on b sequences of s tokens, width h, a heads, each rank of a
context-parallel group of n ranks holds s/n tokens, and
:class:`~course_lib.cp.ContextParallelAttention` saves (in elements):

    b (s/n) h        the qkv Linear's input x
    3 b (s/n) h      q, k and v (RingAttention's contiguous copies of them)
    b (s/n) h        the attention output O (RingAttention, for D = rowsum(dO O))
    b a (s/n)        its log-sum-exp (to rebuild P = exp(S - lse) block by block)
    b (s/n) h        the proj Linear's input: O again, laid out (b, s/n, h)

    :func:`activation_bytes` = e (6 b (s/n) h + b a (s/n))      (e bytes an element)

Nothing is s x s: a rank keeps O(s/n), and n ranks hold a sequence n times longer in
the same memory. The last line is O twice over: the proj Linear saves its own copy of
what RingAttention saves in the heads-first layout, one b (s/n) h of the six.

The dense layer (:class:`~course_lib.models.CausalSelfAttention`) depends on the kernel
``scaled_dot_product_attention`` picks (:func:`dense_activation_bytes`):

    "fused" (flash attention, torch's choice on the CPU in float32):
        e (5 b s h + b a s): x, the qkv output (q, k, v are views of it), O (which the
        proj Linear's input is a view of) and the log-sum-exp: linear in s too;
    "math" (the textbook softmax(Q K^T / sqrt(d)) V):
        e (5 b s h + b a s^2): x, q, k, v, the proj input and the s x s probabilities
        of every head: quadratic in s, what a fused kernel exists to avoid (when b or
        a is 1, v is a view of the qkv output, which is then kept whole: 2 b s h more).
"""
from __future__ import annotations

import torch
import torch.nn as nn


def _storage_key(t):
    storage = t.untyped_storage()
    return (t.device, storage.data_ptr()), storage.nbytes()


def _parameters_of(fn, args, kwargs):
    """The parameters reachable from ``fn`` and its arguments (modules, bound methods)."""
    found = []
    for obj in (fn, getattr(fn, "__self__", None), *args, *kwargs.values()):
        if isinstance(obj, nn.Module):
            found.extend(obj.parameters())
        elif isinstance(obj, nn.Parameter):
            found.append(obj)
    return found


def saved_bytes(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), bytes)``: the bytes of the distinct storages autograd
    saved for backward while ``fn`` ran, parameters' storages left out."""
    params = {_storage_key(p)[0] for p in _parameters_of(fn, args, kwargs)}
    storages = {}

    def pack(t):
        # a saved weight is often a view of its Parameter (the t() under a Linear)
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            key, nbytes = _storage_key(t)
            if key not in params:
                storages[key] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args, **kwargs)
    return result, sum(storages.values())


def _local_tokens(seq_len, cp):
    if seq_len % cp:
        raise ValueError(f"a sequence of {seq_len} does not cut into {cp} equal chunks")
    return seq_len // cp


def activation_bytes(batch, seq_len, dim, heads, cp, element_size=4):
    """Bytes one ContextParallelAttention layer saves per rank at ``cp`` ranks on a
    sequence of ``seq_len`` tokens: e (6 b (s/n) h + b a (s/n))."""
    t = _local_tokens(seq_len, cp)
    return element_size * (6 * batch * t * dim + batch * heads * t)


def dense_activation_bytes(batch, seq_len, dim, heads, element_size=4, kernel="fused"):
    """Bytes the dense CausalSelfAttention saves: e (5 b s h + b a s) with a fused
    attention kernel, e (5 b s h + b a s^2) with the math one (b > 1, a > 1)."""
    if kernel not in ("fused", "math"):
        raise ValueError(f"kernel must be 'fused' or 'math', got {kernel!r}")
    tokens = batch * seq_len
    if kernel == "fused":
        return element_size * (5 * tokens * dim + batch * heads * seq_len)
    # the math kernel's batched matmul takes v as (b a, s, d/a): a view of the qkv output
    # (which then stays whole, 3 b s h) when b or a is 1, a copy (b s h) otherwise
    v_kept = 3 * tokens * dim if batch == 1 or heads == 1 else tokens * dim
    return element_size * (4 * tokens * dim + v_kept + batch * heads * seq_len ** 2)
