"""FSDP's memory accounting under real torchrun: ZeRO-3's formula plus padding, and the peak bound."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import ship_by_value
from course_lib import run
from course_lib.fsdp import FSDP, by_type
from course_lib.memory import fsdp_peak_param_bytes, model_state_bytes, model_state_bytes_of
from course_lib.models import GPT, Block, GPTConfig

ship_by_value(__name__)

CFG = GPTConfig(vocab=37, dim=22, layers=3, heads=2, seq_len=8)  # nothing divides by 3


def state_and_peak(prefetch):
    model = FSDP(GPT(CFG, seed=0), units=by_type(Block), prefetch=prefetch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    flats = [f for u in model.units for f in u.flats]
    whole = []

    def gathered_now(*_):  # every shard, plus the full buffers that exist at this moment
        shards = sum(f.shard.numel() for f in flats)
        full = sum(f.padded for f in flats if f.unsharded or f.pending is not None)
        whole.append(4 * (shards + full))

    for block in model.module.blocks:
        block.register_forward_hook(gathered_now)
        block.register_full_backward_hook(gathered_now)
    x = torch.randint(0, CFG.vocab, (2, CFG.seq_len))
    for _ in range(2):  # the second step prefetches (the order is known)
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, CFG.vocab), x.reshape(-1)).backward()
        opt.step()
    padded = sum(f.padded for f in flats)
    root = [4 * f.padded for u in model.units if u.name == "" for f in u.flats]
    blocks = [4 * f.padded for u in model.units if u.name for f in u.flats]
    return model_state_bytes_of(model, opt), padded, blocks, root, max(whole)


def test_model_state_per_rank_is_zero_3_plus_padding_and_the_peak_is_bounded():
    n, p = 3, sum(p.numel() for p in GPT(CFG).parameters())
    for prefetch in (0, 1):
        for state, padded, blocks, root, peak in run(state_and_peak, prefetch, nproc=n,
                                                     timeout=120):
            assert padded > p  # padding was needed
            want = model_state_bytes(padded, n, stage=3, mixed=False)  # 16 (P + pad) / n, fp32
            assert state == {k: want[k] for k in state}
            assert want["total"] - model_state_bytes(p, n, 3, mixed=False)["total"] < 16 * (
                len(blocks) + len(root))  # the padding costs under one element per rank and unit
            # the root stays whole from its forward to its backward, as FSDP2's does
            bound = fsdp_peak_param_bytes(blocks + root, n, prefetch, root_bytes=sum(root))
            assert peak <= bound
            if prefetch == 0:  # a block computing, the root whole: the bound is reached
                assert peak == bound
