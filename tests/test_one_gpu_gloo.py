"""One GPU, several gloo ranks: the GPU a student most often has.

Every process of such a job sees the GPU unless told otherwise, and torch decides some
devices from what the process sees rather than from the job's backend (``fully_shard``
without a mesh builds its default mesh on ``torch._C._get_accelerator()``: rank 1 goes
to cuda:1 and fails with "invalid device ordinal"). Two layers keep gloo ranks on the
CPU: the launcher hides the GPUs from them (``CUDA_VISIBLE_DEVICES=""``, which also
covers torch's internal choices: DCP's writer, the optimizers' graph-capture check),
and the course gives torch the job's device and mesh explicitly
(``runtime.backend.current_device`` / ``device_mesh``).

These tests start the ranks with ``tests/gpu_lookalike`` on their path. With
``COURSE_LIB_GPU_LOOKALIKE=unhidden`` they answer torch's questions as a rank that
sees one GPU despite the hiding, while any real CUDA work raises: the second layer
alone must keep every benchmark on the CPU.

The notebook side (this pytest process) is not patched: it sees no GPU and picks gloo,
as a one-GPU machine does for two ranks.
"""
import os

import pytest
import torch

from conftest import path_with_lookalike, ship_by_value
from course_lib import run

ship_by_value(__name__)

def lookalike(monkeypatch, mode):
    """Jobs started from now on see one GPU (``mode``: see tests/gpu_lookalike); each
    call is a fresh job, never kept warm, so no later test inherits the patched ranks."""
    monkeypatch.setenv("COURSE_LIB_GPU_LOOKALIKE", mode)
    monkeypatch.setenv("PYTHONPATH", path_with_lookalike())
    monkeypatch.setenv("COURSE_LIB_WARM", "0")


@pytest.fixture
def one_gpu(monkeypatch):
    lookalike(monkeypatch, "unhidden")


def what_the_rank_sees():
    import torch.distributed as dist

    from course_lib.runtime.backend import current_device, device_mesh

    try:
        torch.zeros(1, device="cuda")
        cuda_work = "ran"
    except (RuntimeError, AssertionError) as exc:
        cuda_work = str(exc)
    return {"available": torch.cuda.is_available(), "count": torch.cuda.device_count(),
            "accelerator": torch._C._get_accelerator().type, "backend": dist.get_backend(),
            "device": str(current_device()), "mesh": device_mesh().device_type,
            "cuda_work": cuda_work}


def test_the_ranks_believe_in_a_gpu_and_the_course_keeps_them_on_the_cpu(one_gpu):
    seen = run(what_the_rank_sees, nproc=2, timeout=120)
    for rank in seen:
        assert rank["available"] and rank["count"] == 1 and rank["accelerator"] == "cuda"
        assert rank["backend"] == "gloo" and rank["device"] == "cpu" and rank["mesh"] == "cpu"
        if not torch.cuda.is_available():  # the lookalike; on a real GPU the work runs
            assert "not compiled with CUDA" in rank["cuda_work"]


def fsdp2_and_ours():
    from course_lib.bench import fsdp as bench_fsdp

    cfg = bench_fsdp.config(dim=32, layers=2, heads=2, vocab=64, seq_len=16)
    return bench_fsdp.measure(cfg, batch=2, steps=1, rounds=1,
                              names=["torch FSDP2", "FSDP full", "DDP + ZeRO-1"])


def test_torch_fsdp2_beside_ours_runs_on_the_cpu_ranks(one_gpu):
    """Lab 03's comparison: before the mesh was given explicitly, rank 1 failed with
    'invalid device ordinal' on a one-GPU machine (here: 'not compiled with CUDA')."""
    result = run(fsdp2_and_ours, nproc=2, timeout=300)[0]
    assert set(result) == {"torch FSDP2", "FSDP full", "DDP + ZeRO-1"}
    assert all(row["step_s"] > 0 for row in result.values())


def every_benchmark_tiny():
    """One small call of each lab's benchmark code that builds a mesh, a DTensor, a
    process-wide attention dispatch or a Lightning trainer. (Not DCP: its writer takes a
    CUDA stream whenever ``torch.cuda.is_available()``, torch's choice, which only the
    hiding covers.)"""
    from course_lib.bench import cp as bench_cp
    from course_lib.bench import ep as bench_ep
    from course_lib.bench import tp as bench_tp
    from course_lib.ddp import frameworks
    from course_lib.mesh import ParallelDims

    done = {}
    cp = bench_cp.measure(batch=1, heads=2, seq=16, head_dim=8, steps=1, rounds=1)
    done["cp"] = sorted(cp["step_s"])
    tp = bench_tp.measure(bench_tp.config(dim=32, heads=2, seq_len=8), batch=2, steps=1,
                          rounds=1)
    done["tp"] = sorted(tp["step_s"])
    done["ep"] = sorted(bench_ep.measure(tokens=64, dim=16, experts=4, steps=1, rounds=1,
                                         split_steps=1)["step_s"])
    done["lightning"] = len(frameworks.lightning_losses(steps=2))
    dims = ParallelDims(dp=2).build()
    done["mesh"] = dims.mesh.device_type
    dims.destroy()
    return done


def test_every_benchmark_stays_on_the_cpu_ranks(one_gpu):
    done = run(every_benchmark_tiny, nproc=2, timeout=600)[0]
    assert {"zigzag", "contiguous", "dense"} <= set(done["cp"])
    assert done["lightning"] == 2 and done["mesh"] == "cpu"
    assert done["tp"] and done["ep"]


def what_a_gloo_rank_sees(backend):
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()


def test_the_launcher_hides_the_gpus_from_gloo_ranks(monkeypatch):
    """The machine as it is (lookalike mode 1): the notebook side would see the GPU, a
    gloo rank sees none."""
    lookalike(monkeypatch, "1")
    for hidden, available in run(what_a_gloo_rank_sees, "gloo", nproc=2, backend="gloo",
                                 timeout=120):
        assert hidden == "" and available is False


def dense_after_torch_context_parallel():
    """torch's context_parallel raises on CPU ranks; the dense attention after it must
    be torch's own again."""
    import torch.nn.functional as F

    from course_lib.bench import cp as bench_cp

    sdpa = F.scaled_dot_product_attention
    whole = bench_cp._whole(1, 2, 8, 4, 0, torch.device("cpu"))
    mesh = bench_cp.device_mesh()
    try:
        bench_cp._torch_steps(mesh, whole, 1)
        raised = None
    except Exception as exc:  # noqa: BLE001 - the CPU has no sharding rule for it
        raised = type(exc).__name__
    restored = F.scaled_dot_product_attention is sdpa
    out = bench_cp._dense_step(*whole)[0]
    want = torch.softmax((whole[0] @ whole[1].transpose(-2, -1)) / 2
                         + torch.full((8, 8), float("-inf")).triu(1), -1) @ whole[2]
    return raised, restored, (out - want).abs().max().item()


def test_the_dense_step_after_torch_context_parallel_is_torchs_own():
    raised, restored, diff = run(dense_after_torch_context_parallel, nproc=2, timeout=120)[0]
    assert restored and diff < 1e-5, (raised, restored, diff)


def test_sdpa_is_restored_when_the_body_raises():
    """What torch 2.11 does not do on its own: the patched attention stays after an
    exception inside ``context_parallel``. The guard puts it back whatever torch does."""
    import torch.nn.functional as F

    from course_lib.bench.cp import sdpa_restored

    original = F.scaled_dot_product_attention
    with pytest.raises(ZeroDivisionError):
        with sdpa_restored():
            F.scaled_dot_product_attention = lambda *a, **k: None  # a leaked patch
            1 / 0
    assert F.scaled_dot_product_attention is original
