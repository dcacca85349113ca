"""The vocabulary split (stretch) under real torchrun (gloo), t = 1, 2, 3: the
embedding and the cross-entropy equal the dense ones, gradients included, and
the loss moves three all-reduces of b*s numbers instead of the b*s*V logits."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tp_helpers as H
from conftest import ship_by_value
from course_lib import run
from course_lib.models import param_by_name

ship_by_value(__name__)
ship_by_value("tp_helpers")

WORLD, V, D, B, S = 3, 12, 5, 3, 5


def _tokens(seed):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed), device="cpu")


def dense_embedding():
    return H.randomize(nn.Embedding(V, D), seed=3)


def all_vocab_cases():
    from course_lib import comm
    from course_lib.tp import VocabParallelEmbedding, vocab_parallel_cross_entropy

    out = {}
    for t in (1, 2, 3):
        group = H.tp_group(t)
        size, me = dist.get_world_size(group), dist.get_rank(group)
        for kind in ("torch", "ring"):
            emb = VocabParallelEmbedding.from_dense(dense_embedding(), group, collectives=kind)
            with comm.counting() as fwd:
                y = emb(_tokens(1))
            (y * H.seeded(2, B, S, D)).sum().backward()
            out[t, kind, "emb"] = (y.detach(), emb.weight.detach(), emb.weight.grad,
                                   dict(fwd.collectives))

            logits = H.seeded(4, B, S, V).chunk(size, -1)[me].clone().requires_grad_()
            with comm.counting() as fwd:
                loss = vocab_parallel_cross_entropy(logits, _tokens(5), group, kind)
            with comm.counting() as bwd:
                (loss * H.seeded(6, B, S)).sum().backward()
            out[t, kind, "ce"] = (loss.detach(), logits.grad, dict(fwd.collectives),
                                  dict(fwd.collective_bytes), dict(bwd.collectives))
        by_name = VocabParallelEmbedding(V, D, group=group, name="tok", seed=2)
        out[t, "by_name"] = by_name.weight.detach()
        out[t, "group"] = (size, me)
        try:
            VocabParallelEmbedding(7, D, group=group)
            out[t, "uneven"] = None
        except ValueError as exc:
            out[t, "uneven"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    return run(all_vocab_cases, nproc=WORLD, timeout=120)


@pytest.mark.parametrize("t", [1, 2, 3])
@pytest.mark.parametrize("kind", ["torch", "ring"])
def test_vocab_parallel_embedding_equals_dense(results, t, kind):
    dense = dense_embedding()
    y = dense(_tokens(1))
    (y * H.seeded(2, B, S, D)).sum().backward()
    for out in results:
        size, me = out[t, "group"]
        got_y, weight, grad, calls = out[t, kind, "emb"]
        torch.testing.assert_close(got_y, y.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(weight, dense.weight.detach().chunk(size, 0)[me])
        torch.testing.assert_close(grad, dense.weight.grad.chunk(size, 0)[me])
        assert calls == ({"all_reduce": 1} if size > 1 else {})


@pytest.mark.parametrize("t", [1, 2, 3])
@pytest.mark.parametrize("kind", ["torch", "ring"])
def test_vocab_parallel_cross_entropy_equals_dense_without_gathering_logits(results, t, kind):
    logits = H.seeded(4, B, S, V).requires_grad_()
    loss = F.cross_entropy(logits.reshape(-1, V), _tokens(5).reshape(-1), reduction="none")
    (loss.reshape(B, S) * H.seeded(6, B, S)).sum().backward()
    for out in results:
        size, me = out[t, "group"]
        got, grad, fwd, fwd_bytes, bwd = out[t, kind, "ce"]
        torch.testing.assert_close(got, loss.detach().reshape(B, S), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, logits.grad.chunk(size, -1)[me], rtol=1e-5, atol=1e-6)
        assert bwd == {}
        if size > 1:  # max, target logit, sum of exponentials: b*s floats each
            assert fwd == {"all_reduce": 3} and fwd_bytes == {"all_reduce": 3 * B * S * 4}


def test_a_vocab_shard_built_by_name_is_a_slice_of_the_full_table(results):
    full = param_by_name("tok.weight", (V, D), 2)
    for out in results:
        for t in (1, 2, 3):
            size, me = out[t, "group"]
            assert torch.equal(out[t, "by_name"], full.chunk(size, 0)[me])


def test_a_vocabulary_that_does_not_divide_is_refused(results):
    for out in results:
        for t in (1, 2, 3):
            size, _ = out[t, "group"]
            message = out[t, "uneven"]
            assert (message is None) == (size == 1)
            if message:
                assert "= 7" in message and f"t = {size}" in message
