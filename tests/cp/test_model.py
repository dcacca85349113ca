"""The course GPT trained with context parallelism (gloo, cp = 2 and 3, contiguous and
zigzag) equals one process on the whole batch: the losses step by step and the weights."""
import pytest
import torch

from conftest import ship_by_value
from course_lib import run
from course_lib.pipeline.runs import corpus_batches, corpus_config

ship_by_value(__name__)

CFG = corpus_config(layers=2, dim=24, heads=3, seq_len=12)  # 12 = 2 x 6 = 3 x 4 = 2 x 3 x 2
STEPS, BATCH, LR = 3, 4, 3e-3


def train_cp(layout):
    import torch.distributed as dist

    from course_lib.cp import context_parallel, cp_loss, sum_gradients
    from course_lib.models import GPT

    model = context_parallel(GPT(CFG, seed=0), layout=layout)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in corpus_batches(CFG, BATCH, STEPS, "cpu"):
        opt.zero_grad(set_to_none=True)
        share = cp_loss(model, x, y, layout=layout)
        share.backward()
        sum_gradients(model)
        total = share.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world,layout", [(2, "contiguous"), (3, "contiguous"), (2, "zigzag"),
                                          (3, "zigzag")])
def test_context_parallel_training_equals_one_process(world, layout):
    from course_lib.models import GPT

    model = GPT(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in corpus_batches(CFG, BATCH, STEPS, "cpu"):
        opt.zero_grad(set_to_none=True)
        loss = model.loss(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    want = dict(model.named_parameters())
    for got_losses, state in run(train_cp, layout, nproc=world):
        assert got_losses == pytest.approx(losses, abs=1e-5)
        for name, tensor in state.items():
            assert torch.allclose(tensor, want[name].detach(), atol=5e-4), name
