"""Activation checkpointing: the same gradients, fewer bytes kept between forward and backward."""
import torch

from course_lib.memory.checkpointing import Checkpointed, checkpoint_blocks, compare_checkpointing
from course_lib.models import GPT, GPTConfig

CFG = GPTConfig(vocab=50, dim=32, layers=3, heads=4, seq_len=16)


def test_checkpointed_blocks_give_the_same_gradients():
    tokens = torch.randint(0, CFG.vocab, (3, CFG.seq_len), generator=torch.Generator().manual_seed(0))
    plain, ckpt = GPT(CFG, seed=1), checkpoint_blocks(GPT(CFG, seed=1))
    assert all(isinstance(b, Checkpointed) for b in ckpt.blocks)
    plain.loss(tokens, tokens).backward()
    ckpt.loss(tokens, tokens).backward()
    grads = {n.replace(".module.", "."): p.grad for n, p in ckpt.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7)


def test_checkpointing_keeps_fewer_bytes_for_backward():
    report = compare_checkpointing(CFG, batch=4, rounds=1)
    # each block keeps only its input instead of its ~10 intermediates
    assert report["on"]["kept_bytes"] < 0.5 * report["off"]["kept_bytes"]
    assert report["on"]["peak_bytes"] < report["off"]["peak_bytes"]


def test_without_grad_nothing_is_recomputed():
    block = Checkpointed(torch.nn.Linear(3, 3))
    with torch.no_grad():
        assert block(torch.ones(1, 3)).grad_fn is None
