"""Our resharding load against torch.distributed.checkpoint's (DCP) on the same state: the
tiny GPT trained two AdamW steps under our FSDP on 4 gloo ranks is saved twice, by us
(flat ranges of each unit's shard) and by DCP (each whole tensor split by rows over the 4
ranks); on 2 ranks under tensor parallelism, our load and DCP's (whole tensors, cut by the
same boxes) give every box of every parameter, moment and step, bit for bit."""
import torch

from conftest import ship_by_value
from course_lib import run
from course_lib.pipeline.runs import corpus_batches, corpus_config, gpt_loss

ship_by_value(__name__)

CFG = corpus_config(layers=2, dim=24, heads=2, seq_len=8)  # 24 x 24 weights: uneven shards


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


def train_and_save_both(root):
    from course_lib.checkpoint import save, state_of
    from course_lib.checkpoint.dcp_reference import dense_state, save_dense

    model, opt = build("fsdp")
    for x, y in corpus_batches(CFG, 2, 4, "cpu"):  # every rank the same batch
        opt.zero_grad(set_to_none=True)
        gpt_loss(CFG.vocab)(model(x), y).backward()
        opt.step()
    save(state_of(model, opt), root / "ours")
    dense = dense_state(model, opt)
    save_dense(dense, root / "dcp")
    return {name: t.shape for name, t in dense.items()}


def pieces(value):
    if isinstance(value, torch.Tensor):
        return [value]
    return [value.local] if hasattr(value, "local") else [v.local for v in value]


def load_both_and_compare(root):
    """On each rank: {name: number of boxes}, the names of boxes that differ, and of
    boxes that are still the NaN they started as."""
    from course_lib.checkpoint import load, state_of
    from course_lib.checkpoint.dcp_reference import dcp_boxes, empty_like_state
    from course_lib.checkpoint.state import ensure_optimizer_state

    model, opt = build("tp")
    ensure_optimizer_state(model, opt)  # Adam makes its moments at the first step
    ours = state_of(model, opt)
    with torch.no_grad():
        for value in ours.values():  # a box our load missed stays NaN
            for t in pieces(value):
                t.fill_(float("nan"))
    theirs = empty_like_state(ours)
    load(ours, root / "ours")
    filled = dcp_boxes(root / "dcp", theirs)
    assert sorted(filled) == sorted(ours)
    boxes, differ, unfilled = {}, [], []
    for name in ours:
        mine, reference = pieces(ours[name]), pieces(theirs[name])
        boxes[name] = len(mine)
        for i, (a, b) in enumerate(zip(mine, reference, strict=True)):
            if torch.isnan(a).any() or torch.isnan(b).any():
                unfilled.append(f"{name}[{i}]")
            elif not (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
                differ.append(f"{name}[{i}]")
    return boxes, differ, unfilled


def test_our_load_agrees_with_dcp_box_by_box(tmp_path):
    shapes = run(train_and_save_both, tmp_path, nproc=4, timeout=180)[0]
    plain, _ = build("plain")
    params = {n: p.shape for n, p in plain.named_parameters()}
    moments = {f"optim.{n}.{k}": s for n, s in params.items() for k in ("exp_avg", "exp_avg_sq")}
    assert shapes == {**params, **moments, "optim.step": torch.Size([])}

    for rank, (boxes, differ, unfilled) in enumerate(
            run(load_both_and_compare, tmp_path, nproc=2, timeout=180)):
        assert not unfilled, f"rank {rank}: boxes left unfilled: {unfilled}"
        assert not differ, f"rank {rank}: ours and DCP differ in {differ}"
        assert set(boxes) == set(shapes)
        # the fused q/k/v weight is three boxes a rank (its rows of each of q, k and v),
        # and so are its moments: the geometry the two loads must agree on
        assert boxes["blocks.0.attn.qkv.weight"] == 3
        assert boxes["optim.blocks.1.attn.qkv.weight.exp_avg_sq"] == 3
