"""Our resharding load against torch.distributed.checkpoint's (DCP) on the same state: the
tiny GPT trained two AdamW steps under our FSDP on 4 gloo ranks is saved twice, by us
(flat ranges of each unit's shard) and by DCP (each whole tensor split by rows over the 4
ranks); on 2 ranks under tensor parallelism, our load and DCP's (whole tensors, cut by the
same boxes) give every box of every parameter, moment and step, bit for bit; and the
losses after the save are the same on 4 FSDP ranks and 2 TP ranks."""
import torch

from conftest import ship_by_value
from course_lib import run
from course_lib.checkpoint import reshard

ship_by_value(__name__)


def dense_shapes():
    plain, _ = reshard.build("plain")
    params = {n: p.shape for n, p in plain.named_parameters()}
    moments = {f"optim.{n}.{k}": s for n, s in params.items() for k in ("exp_avg", "exp_avg_sq")}
    return {**params, **moments, "optim.step": torch.Size([])}


def test_our_load_agrees_with_dcp_box_by_box(tmp_path):
    saved = run(reshard.train_and_save, tmp_path, nproc=4, timeout=180)
    for rank, out in enumerate(run(reshard.compare_with_dcp, tmp_path, "tp", nproc=2,
                                   timeout=180)):
        assert not out["unfilled"], f"rank {rank}: boxes left unfilled: {out['unfilled']}"
        assert not out["differ"], f"rank {rank}: ours and DCP differ in {out['differ']}"
        assert set(out["boxes"]) == set(dense_shapes())
        # the fused q/k/v weight is three boxes a rank (its rows of each of q, k and v),
        # and so are its moments: the geometry the two loads must agree on
        assert out["boxes"]["blocks.0.attn.qkv.weight"] == 3
        assert out["boxes"]["optim.blocks.1.attn.qkv.weight.exp_avg_sq"] == 3
    after = run(reshard.continue_from, tmp_path / "ours", "tp", nproc=2, timeout=180)
    for out in after:
        assert torch.allclose(torch.tensor(out["losses"]), torch.tensor(saved[0]["losses"]),
                              atol=1e-5)
