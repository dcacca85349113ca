"""The hybrid planner: its arithmetic against independent counts, the simulator and brute force."""
import dataclasses
import itertools

import pytest

from course_lib.hybrid.plan import (A100_40GB, GPUS, H100_80GB, Mesh, Workload, best_mesh, fits,
                                    memory_per_gpu, params_per_gpu, plan_table, pp_messages,
                                    step_time, valid_meshes)
from course_lib.memory.estimate import GB, OLMO, ModelShape, param_count
from course_lib.pipeline import bubble_fraction, one_f_one_b, simulate

O1, O7, O70 = OLMO["OLMo 1B"], OLMO["OLMo 7B"], OLMO["OLMo 70B"]
TINY = ModelShape(vocab=64, dim=32, seq_len=16, layers=4, heads=4)


def test_one_gpu_holds_exactly_p():
    for shape in [*OLMO.values(), TINY]:
        assert params_per_gpu(shape, Mesh()) == param_count(shape)
        # dp replicates: it never changes what a GPU holds
        assert params_per_gpu(shape, Mesh(dp=8)) == param_count(shape)


def test_tp_splits_and_pp_keeps_the_ends_on_the_end_stages():
    p = param_count(O7)
    assert params_per_gpu(O7, Mesh(tp=2)) == pytest.approx(p / 2)
    assert params_per_gpu(O7, Mesh(tp=4)) == pytest.approx(p / 4)
    d, v, t = O7.dim, O7.vocab, O7.seq_len
    block, embed, head = 12 * d * d + 10 * d, d * (v + t), 2 * d + v * (d + 1)
    # the embeddings (V + T rows) outweigh the head (V rows): stage 0 holds the most
    assert embed > head
    assert params_per_gpu(O7, Mesh(pp=O7.layers)) == block + embed
    assert params_per_gpu(O7, Mesh(pp=2)) == 16 * block + embed
    assert params_per_gpu(O7, Mesh(tp=2, pp=2)) == pytest.approx((16 * block + embed) / 2)


def test_zero3_shards_everything_but_the_gathered_units():
    p, w = param_count(O1), Workload(zero=3)
    mem = memory_per_gpu(O1, Mesh(dp=8), w)
    assert mem["optimizer"] == pytest.approx(12 * p / 8)
    assert mem["grads"] == pytest.approx(2 * p / 8)
    # plus two whole units (computing and prefetched): the embedding, the largest
    assert mem["params"] == pytest.approx(2 * p / 8 + 2 * 2 * O1.dim * (O1.vocab + O1.seq_len))
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))
    ddp = memory_per_gpu(O1, Mesh(dp=8), Workload(zero=0))
    assert (ddp["params"], ddp["grads"], ddp["optimizer"]) == (2 * p, 2 * p, 12 * p)


def test_activations_per_layer_in_flight_and_checkpointed():
    s, h, n, v = O7.seq_len, O7.dim, O7.layers, O7.vocab
    b = 2
    full = memory_per_gpu(O7, Mesh(tp=2), Workload(micro_batch=b))["activations"]
    assert full == 34 * s * b * h * n / 2 + 4 * s * b * v / 2
    ckpt = memory_per_gpu(O7, Mesh(tp=2), Workload(micro_batch=b, checkpointing=True))
    assert ckpt["activations"] == (2 * n + 34) * s * b * h / 2 + 4 * s * b * v / 2
    # pp=4, 1F1B: stage 0 keeps 4 microbatches of its 8 layers (no logits there)
    piped = memory_per_gpu(O7, Mesh(pp=4), Workload())
    assert piped["activations"] == 34 * s * h * 8 * 4
    # with fewer microbatches than stages, only those are in flight
    few = memory_per_gpu(O7, Mesh(dp=1024, pp=4), Workload(global_batch=2048))
    assert few["activations"] == 34 * s * h * 8 * 2


def test_valid_meshes_are_every_allowed_factorisation_once():
    w = Workload()
    for shape, n in [(O1, 8), (O7, 64), (O70, 256), (TINY, 12)]:
        meshes = valid_meshes(shape, n, w)
        triples = [(dp, tp, n // (dp * tp)) for dp in range(1, n + 1) for tp in range(1, n + 1)
                   if n % (dp * tp) == 0]
        want = {(dp, tp, pp) for dp, tp, pp in triples if shape.heads % tp == 0 and tp <= 4
                and pp <= shape.layers and w.global_batch % dp == 0}
        assert len(meshes) == len(want)
        assert {(m.dp, m.tp, m.pp) for m in meshes} == want
        assert meshes == valid_meshes(shape, n, w)  # deterministic


def test_tp_never_leaves_a_node():
    assert all(m.tp <= 4 for m in valid_meshes(O70, 256, Workload()))
    # 8 heads would allow tp=8: only a node of 8 does
    assert any(m.tp == 8 for m in valid_meshes(O70, 256, Workload(), gpus_per_node=8))


def test_best_mesh_is_the_brute_force_minimum():
    for shape, n, gpu, w in [(O1, 8, A100_40GB, Workload()), (O7, 16, A100_40GB, Workload()),
                             (O7, 32, H100_80GB, Workload(zero=3)),
                             (O70, 64, H100_80GB, Workload(checkpointing=True))]:
        best = None
        for dp, tp, pp in itertools.product(range(1, n + 1), repeat=3):
            mesh = Mesh(dp=dp, tp=tp, pp=pp)
            if (dp * tp * pp != n or shape.heads % tp or tp > 4 or pp > shape.layers
                    or w.global_batch % dp or not fits(shape, mesh, w, gpu)):
                continue
            total = step_time(shape, mesh, w, gpu)["total"]
            best = min(best or (total, mesh), (total, mesh), key=lambda x: x[0])
        mesh, t = best_mesh(shape, n, w, gpu)
        assert t["total"] == pytest.approx(best[0])
        assert memory_per_gpu(shape, mesh, w)["total"] <= 0.9 * gpu.memory_gb * GB


def test_bubble_is_the_1f1b_fraction():
    for mesh in [Mesh(dp=8, pp=4), Mesh(dp=2, tp=2, pp=8), Mesh(pp=16)]:
        w = Workload(global_batch=256)
        m = w.microbatches(mesh)
        t = step_time(O7, mesh, w, H100_80GB)
        share = t["bubble"] / (t["compute"] + t["bubble"])
        assert share == pytest.approx(bubble_fraction(mesh.pp, m))


def test_pp_messages_match_the_simulator():
    for p in range(2, 7):
        for m in range(1, 13):
            sim = simulate(one_f_one_b(p, m), t_f=1.0, t_b=2.0, t_comm=0.01)
            extra = (sim.makespan - (m + p - 1) * 3.0) / 0.01
            assert extra == pytest.approx(pp_messages(p, m)), (p, m)


def test_mfu_is_one_for_compute_alone_and_below_otherwise():
    t = step_time(TINY, Mesh(), Workload(global_batch=8), H100_80GB)
    assert t["compute"] == t["total"] and t["mfu"] == pytest.approx(1.0)
    half = step_time(TINY, Mesh(), Workload(global_batch=8), H100_80GB, efficiency=0.5)
    assert half["mfu"] == pytest.approx(0.5)
    tokens = 2048 * O7.seq_len
    for mesh in valid_meshes(O7, 32, Workload()):
        t = step_time(O7, mesh, Workload(), H100_80GB)
        assert 0 < t["mfu"] <= 1
        want = 6 * param_count(O7) * tokens / (t["total"] * 32 * H100_80GB.tflops * 1e12)
        assert t["mfu"] == pytest.approx(want)


def test_recompute_costs_a_forward_and_two_all_reduces():
    mesh = Mesh(dp=8, tp=4)
    plain = step_time(O7, mesh, Workload(), H100_80GB)
    ckpt = step_time(O7, mesh, Workload(checkpointing=True), H100_80GB)
    assert ckpt["compute"] == pytest.approx(plain["compute"] * 8 / 6)
    assert ckpt["tp_comm"] == pytest.approx(plain["tp_comm"] * 6 / 4)
    assert ckpt["mfu"] < plain["mfu"]


def test_dp_ring_inside_a_node_uses_nvlink():
    slow_ib = dataclasses.replace(H100_80GB, ib_gbps=1.0)
    w = Workload(zero=0)
    for mesh, crosses in [(Mesh(dp=4), False), (Mesh(dp=2, tp=2), False), (Mesh(dp=8), True),
                          (Mesh(dp=2, tp=4), True), (Mesh(dp=2, pp=4), False)]:
        fast, slow = (step_time(O1, mesh, w, g)["dp_comm"] for g in (H100_80GB, slow_ib))
        assert (slow > fast) == crosses, mesh


def test_more_bandwidth_never_slows_a_step():
    for zero, ckpt in itertools.product(range(4), (False, True)):
        w = Workload(zero=zero, checkpointing=ckpt)
        for gpu in GPUS.values():
            faster = dataclasses.replace(gpu, nvlink_pair_gbps=2 * gpu.nvlink_pair_gbps,
                                         ib_gbps=3 * gpu.ib_gbps, ib_alpha_s=gpu.ib_alpha_s / 2)
            for mesh in valid_meshes(O7, 64, w):
                assert (step_time(O7, mesh, w, faster)["total"]
                        <= step_time(O7, mesh, w, gpu)["total"]), (mesh, zero, ckpt)


def test_70b_does_not_fit_on_8_a100s():
    with pytest.raises(ValueError, match=r"no mesh of 8 x A100 40GB fits.*GB.*ZeRO-3"):
        best_mesh(O70, 8, Workload(zero=3, checkpointing=True), A100_40GB)


def test_bad_workloads_say_why():
    with pytest.raises(ValueError, match="ZeRO stage"):
        Workload(zero=4)
    with pytest.raises(ValueError, match="does not split"):
        Workload(global_batch=100).microbatches(Mesh(dp=8))
    # 7 GPUs: dp=7 does not divide 64 sequences, tp=7 leaves the node, pp=7 > 4 layers
    with pytest.raises(ValueError, match="no mesh of 7 GPUs"):
        best_mesh(TINY, 7, Workload(global_batch=64), H100_80GB)


def test_the_olmo_plan(capsys):
    """What the model says at peak rates, 4 GPUs per node, 2048 x T tokens per step,
    ZeRO-1: 1B is pure data parallel; 7B adds a 2-stage pipeline, not TP: four
    all-reduces per layer on NVLink cost more than a bubble of 1/129; on 128 GPUs
    70B needs TP across the whole node, and on 40 GB cards a 16-stage pipeline too."""
    rows = plan_table()
    assert "OLMo 70B" in capsys.readouterr().out
    got = {(r[0], r[1]): (r[2], r[3], round(r[7], 2)) for r in rows}
    assert got == {
        ("OLMo 1B", "A100 40GB"): (8, "dp=8 tp=1 pp=1", 0.99),
        ("OLMo 1B", "H100 80GB"): (8, "dp=8 tp=1 pp=1", 0.98),
        ("OLMo 7B", "A100 40GB"): (32, "dp=16 tp=1 pp=2", 0.96),
        ("OLMo 7B", "H100 80GB"): (32, "dp=16 tp=1 pp=2", 0.94),
        ("OLMo 70B", "A100 40GB"): (128, "dp=2 tp=4 pp=16", 0.82),
        ("OLMo 70B", "H100 80GB"): (128, "dp=16 tp=4 pp=2", 0.82),
    }
    assert all(r[4] <= 0.9 * GPUS[r[1]].memory_gb for r in rows)


def test_a_switched_node_gives_any_group_the_whole_link_a_wired_board_splits_it_by_peer():
    """One model of NVSwitch everywhere (Lab 01, cp.projection): a ring rank sends to its
    one peer at the GPU's 450 GB/s, whatever the group's size; on the lecture's 4-GPU
    boards a pair has 150 GB/s and a collective over g ranks uses g-1 pairs."""
    from course_lib.hybrid.costs import H100_NVSWITCH_NODE, _link

    switched = {tp: _link(H100_NVSWITCH_NODE, Mesh(tp=tp), "tp")[1] for tp in (2, 4, 8)}
    assert set(switched.values()) == {450e9}
    assert _link(H100_NVSWITCH_NODE, Mesh(pp=2), "pp")[1] == 450e9
    wired = {tp: _link(H100_80GB, Mesh(tp=tp), "tp")[1] for tp in (2, 4)}
    assert wired == {2: 150e9, 4: 450e9}
    assert _link(H100_80GB, Mesh(pp=2), "pp")[1] == 150e9


# ---- context parallelism: a fourth dim ---------------------------------------------------
def test_a_cp_mesh_counts_its_gpus_and_reads_as_before_without_cp():
    assert Mesh(dp=2, tp=2, pp=2, cp=2).n_gpus == 16
    assert str(Mesh(dp=4, tp=2)) == "dp=4 tp=2 pp=1"  # cp = 1 prints as it always did
    assert str(Mesh(dp=2, cp=4)) == "dp=2 tp=1 pp=1 cp=4"


def test_cp_halves_the_activations_and_shards_the_state_as_dp_does():
    w = Workload()
    one, two = memory_per_gpu(O7, Mesh(dp=4, pp=2), w), memory_per_gpu(O7, Mesh(dp=2, pp=2, cp=2), w)
    assert two["activations"] == pytest.approx(one["activations"] / 2)
    # the dp x cp ranks hold the same weights: ZeRO-1 shards the optimizer over all 4
    assert two["optimizer"] == pytest.approx(one["optimizer"])
    assert two["params"] == pytest.approx(one["params"]) and two["grads"] == pytest.approx(one["grads"])


def test_cp_shares_the_tokens_and_charges_the_ring_it_cannot_hide():
    w = Workload(global_batch=64)
    assert step_time(O7, Mesh(dp=2, cp=2), w, H100_80GB)["compute"] == pytest.approx(
        step_time(O7, Mesh(dp=4), w, H100_80GB)["compute"])
    assert step_time(O7, Mesh(dp=4), w, H100_80GB)["cp_comm"] == 0
    # a slow link between the two cp ranks (one per node): the ring shows, step by step
    slow = dataclasses.replace(H100_80GB, ib_gbps=0.01, gpus_per_node=1)
    mesh, m, c = Mesh(dp=1, cp=2), 64, 2
    t = step_time(TINY, mesh, w, slow)
    kv = 2 * (2 * 1 * TINY.seq_len * TINY.dim / c)  # K and V of a chunk, bf16, b = 1
    ring = slow.ib_alpha_s + kv / (slow.ib_gbps * 1e9)
    hidden = t["compute"] / m * 2 / 6 / (TINY.layers * c)  # 1/c of a layer's forward
    assert t["cp_comm"] == pytest.approx(3 * (c - 1) * TINY.layers * m * (ring - hidden))
    assert t["cp_comm"] > 0
    # checkpointing runs the forward ring again, behind a forward that is 2/8 of compute
    ck = step_time(TINY, mesh, dataclasses.replace(w, checkpointing=True), slow)
    hidden = ck["compute"] / m * 2 / 8 / (TINY.layers * c)
    assert ck["cp_comm"] == pytest.approx(4 * (c - 1) * TINY.layers * m * (ring - hidden))


def test_a_long_sequence_fits_only_with_cp():
    shape = dataclasses.replace(O7, seq_len=131072)
    w = Workload(global_batch=32)
    with pytest.raises(ValueError, match="no mesh of 64 x H100 80GB fits"):
        best_mesh(shape, 64, w, H100_80GB)
    mesh, t = best_mesh(shape, 64, w, H100_80GB, cps=(1, 2, 4, 8, 16))
    assert mesh.cp > 1 and fits(shape, mesh, w, H100_80GB)
    assert all(m.cp == 1 for m in valid_meshes(shape, 64, w))  # cp only when asked for
    assert {m.cp for m in valid_meshes(shape, 64, w, cps=(1, 2, 3))} == {1, 2}  # 3 cuts no seq
