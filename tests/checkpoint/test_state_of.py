"""Saved from our FSDP on 4 gloo ranks (parameters and AdamW's moments as flat ranges),
restored into tensor parallelism on 2 ranks, FSDP on 3 and one process: the same
parameters, and the same loss after one more AdamW step on the same batch."""
import torch

from conftest import ship_by_value
from course_lib import run
from course_lib.checkpoint import consolidate
from course_lib.checkpoint.state import restore, state_of
from course_lib.pipeline.runs import corpus_batches, corpus_config, gpt_loss

ship_by_value(__name__)

CFG = corpus_config(layers=2, dim=24, heads=2, seq_len=8)  # 24 x 24 weights: uneven shards


def batches():
    return list(corpus_batches(CFG, 3, 4, "cpu"))


def one_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = gpt_loss(CFG.vocab)(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def build(layout):
    import torch.distributed as dist

    from course_lib.fsdp import FSDP, by_type
    from course_lib.models import GPT, Block
    from course_lib.tp import parallelize_block

    model = GPT(CFG, seed=0)
    if layout == "fsdp":
        model = FSDP(model, units=by_type(Block))
    elif layout == "tp":
        for block in model.blocks:
            parallelize_block(block, dist.group.WORLD)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_and_save(path):
    model, opt = build("fsdp")
    data = batches()
    for x, y in data[:2]:  # every rank the whole batch: the layouts must agree exactly
        one_step(model, opt, x, y)
    from course_lib.checkpoint import save

    save(state_of(model, opt), path)
    return [one_step(model, opt, x, y) for x, y in data[2:]]


def restore_and_continue(path, layout):
    model, opt = build(layout)
    restore(path, model, opt)
    return [one_step(model, opt, x, y) for x, y in batches()[2:]]


def test_fsdp_on_4_restores_into_tp_on_2_fsdp_on_3_and_one_process(tmp_path):
    path = tmp_path / "step_000002"
    want = run(train_and_save, path, nproc=4, timeout=180)[0]
    saved = consolidate(path)
    model, opt = build("plain")
    restore(path, model, opt)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name
        assert torch.equal(opt.state[p]["exp_avg"], saved[f"optim.{name}.exp_avg"]), name
    assert torch.allclose(torch.tensor(restore_and_continue(path, "plain")), torch.tensor(want),
                          atol=1e-6)
    for layout, n in (("tp", 2), ("fsdp", 3)):
        for losses in run(restore_and_continue, path, layout, nproc=n, timeout=180):
            assert torch.allclose(torch.tensor(losses), torch.tensor(want), atol=1e-5), layout
