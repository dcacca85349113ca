"""Init without the whole model: a GPT built on the meta device, sharded by our FSDP
(3 gloo ranks, uneven shards) or tensor parallelism (2 ranks), then given only this
rank's values. Every piece equals the dense init's slice bitwise, a training step
gives the losses of the normally built model, and the measured peak stays under one
shard plus the largest parameter."""
import torch

from conftest import ship_by_value
from course_lib import run
from course_lib.checkpoint.meta_init import LiveBytes, materialize, meta_gpt
from course_lib.models import GPT
from course_lib.pipeline.runs import corpus_batches, corpus_config, gpt_loss

ship_by_value(__name__)

CFG = corpus_config(layers=2, dim=24, heads=2, seq_len=8)  # 24 x 24 weights: uneven shards


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def budget(model):
    """(shard bytes, largest dense parameter's bytes, dense bytes): the bound's parts,
    read off this rank's model and the dense model's shapes (on meta: no memory)."""
    dense = list(meta_gpt(CFG).parameters())
    return nbytes(model.parameters()), max(nbytes([p]) for p in dense), nbytes(dense)


def mismatches(model, dense):
    """Names whose boxes (as a sharded checkpoint sees them) differ from the dense init."""
    from course_lib.checkpoint import ShardedTensor, state_of

    bad = []
    for name, entry in state_of(model).items():
        for box in entry if isinstance(entry, list) else [entry]:
            if isinstance(box, ShardedTensor):
                want = dense[name][tuple(slice(o, o + z) for o, z in zip(*box.box))]
                ok = torch.equal(box.local, want)
            else:  # replicated
                ok = torch.equal(box, dense[name])
            if not ok:
                bad.append(name)
    return bad


def train(model, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in corpus_batches(CFG, 4, steps, "cpu"):
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(CFG.vocab)(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fsdp_rank():
    import torch.distributed as dist

    from course_lib.checkpoint.meta_init import meta_fsdp
    from course_lib.fsdp import FSDP, by_type
    from course_lib.models import Block

    model, peak = meta_fsdp(CFG, dist.group.WORLD)
    dense = dict(GPT(CFG, seed=0).named_parameters())
    normal = FSDP(GPT(CFG, seed=0), units=by_type(Block))
    same_shards = all(torch.equal(a, b) for a, b in zip(model.shards, normal.shards))
    uneven = any(f.numel % dist.get_world_size() for u in model.units for f in u.flats)
    return dict(bad=mismatches(model, dense), same_shards=same_shards, uneven=uneven,
                budget=budget(model), peak=peak, losses=(train(model), train(normal)),
                after=all(torch.equal(a, b) for a, b in zip(model.shards, normal.shards)))


def tp_rank():
    import torch.distributed as dist

    from course_lib.checkpoint.meta_init import meta_tp
    from course_lib.tp import parallelize_block

    model, peak = meta_tp(CFG, dist.group.WORLD)
    dense_model = GPT(CFG, seed=0)
    dense = {n: p.detach().clone() for n, p in dense_model.named_parameters()}
    for block in dense_model.blocks:  # the usual way: cut the dense blocks
        parallelize_block(block, dist.group.WORLD)
    normal = dict(dense_model.named_parameters())
    same = all(torch.equal(p, normal[n]) for n, p in model.named_parameters())
    return dict(bad=mismatches(model, dense), same=same, budget=budget(model), peak=peak,
                losses=(train(model), train(dense_model)))


def test_live_bytes_counts_new_storage_until_its_last_tensor_goes():
    with LiveBytes() as live:
        a = torch.randn(1000)  # 4000 bytes
        view = a[:10]  # no new storage
        del a  # the view keeps it alive
        b = view * 2  # 40 bytes: 4040 at once
        del view
        b.mul_(3)  # in place: nothing new
    assert (live.peak, live.now) == (4040, 40)
    with LiveBytes() as live:
        meta_gpt(CFG)
    assert live.peak == 0  # the meta device holds nothing


def test_one_process_materializes_the_dense_init_holding_exactly_the_model():
    dense = GPT(CFG, seed=3)
    with LiveBytes() as live:
        model = materialize(meta_gpt(CFG), seed=3, device="cpu")
    for (name, p), q in zip(model.named_parameters(), dense.parameters()):
        assert torch.equal(p, q), name
    # each parameter drawn whole is the parameter: nothing else is ever alive
    assert live.peak == nbytes(dense.parameters())
    x, _ = next(corpus_batches(CFG, 2, 1, "cpu"))
    assert torch.equal(model(x), dense(x))


def test_fsdp_on_3_ranks_gets_the_dense_slices_with_one_shard_plus_one_parameter():
    for rank in run(fsdp_rank, nproc=3, timeout=120):
        assert rank["bad"] == [] and rank["same_shards"] and rank["uneven"]
        meta_losses, normal_losses = rank["losses"]
        assert meta_losses == normal_losses  # the same step, bitwise the same loss
        assert rank["after"]  # and the same shards after two AdamW steps
        shard, largest, dense = rank["budget"]
        assert shard <= rank["peak"] <= shard + largest < dense / 2, rank


def test_tp_on_2_ranks_gets_the_dense_slices_with_one_shard_plus_one_parameter():
    for rank in run(tp_rank, nproc=2, timeout=120):
        assert rank["bad"] == [] and rank["same"]
        meta_losses, normal_losses = rank["losses"]
        assert meta_losses == normal_losses
        shard, largest, dense = rank["budget"]
        # embeddings, head and LayerNorms are whole on every rank: less saved than FSDP
        assert shard <= rank["peak"] <= shard + largest < dense, rank
