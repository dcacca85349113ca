"""The jobs Lab 04 runs on its ranks, against one process, and the benchmark end to end."""
import json

import pytest
import torch

from conftest import needs_gpus, ship_by_value
from course_lib import run
from course_lib.bench.__main__ import main as bench_main
from course_lib.models import GPT
from course_lib.pipeline import measured_bubble, peak_in_flight, one_f_one_b
from course_lib.pipeline.runs import (activation_memory, corpus_batches, corpus_config, gpt_loss,
                                      profile_pieces, traced_fixed, traced_gpt, train_gpt)

ship_by_value(__name__)
CFG = corpus_config(layers=2, dim=16, heads=2, seq_len=8)


def one_process_losses(steps, batch):
    """The whole GPT, one process, the whole batch: the losses a pipeline must give."""
    model = GPT(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x, y in corpus_batches(CFG, batch, steps, "cpu"):
        opt.zero_grad()
        loss = gpt_loss(CFG.vocab)(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_train_gpt_losses_are_one_process_losses():
    got = run(train_gpt, CFG, "1f1b", 3, steps=3, batch=6, nproc=2, timeout=120)
    want = one_process_losses(steps=3, batch=6)
    assert got[0] is None and got[1] == pytest.approx(want, rel=1e-5)


def test_activation_memory_follows_the_schedule_in_flight():
    p, m = 2, 4
    for kind in ("gpipe", "1f1b"):
        outs = run(activation_memory, CFG, kind, m, batch=8, nproc=p, timeout=120)
        peaks = peak_in_flight(one_f_one_b(p, m)) if kind == "1f1b" else [m] * p
        for s, (in_flight, held, one) in enumerate(outs):
            assert in_flight == peaks[s]
            assert held == in_flight * one  # equal microbatches: bytes scale with the count


def test_traced_jobs_leave_action_spans():
    pieces = run(traced_gpt, CFG, "gpipe", 2, batch=4, nproc=2, timeout=120)
    assert pieces == [["embed", "blocks.0"], ["blocks.1", "head"]]
    assert 0 < measured_bubble(pieces.trace) < 1
    fixed = run(traced_fixed, 2, "1f1b", 0.001, 0.002, nproc=2, timeout=120)
    assert 0 < measured_bubble(fixed.trace) < 1
    assert fixed.trace.select(cat="comm")  # messages recorded by default
    quiet = run(traced_fixed, 2, "1f1b", 0.001, 0.002, trace_messages=False, nproc=2, timeout=120)
    assert not quiet.trace.select(cat="comm")
    assert len(quiet.trace.select(cat="compute")) == len(fixed.trace.select(cat="compute")) == 8


def test_profile_pieces_times_every_piece():
    times = profile_pieces(CFG, batch=4, repeats=1)
    assert len(times) == CFG.layers + 2 and all(t > 0 for t in times)


def test_benchmark_runs_ours_and_torch_side_by_side(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # in this process: the bench's jobs reuse the warm 2-rank job of the tests above
    assert bench_main(["pipeline", "--nproc", "2", "--width", "32", "--batch", "8", "--rounds",
                       "1", "--t-f", "0.002", "--t-b", "0.004", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["real"]["variants"]) == {"naive", "gpipe", "1f1b"}
    for row in result["real"]["variants"].values():
        assert row["ours_s"] > 0 and row["torch_s"] > 0
    assert [(r["variant"], r["m"]) for r in result["bubbles"]] == [
        (v, m) for v in ("gpipe", "1f1b") for m in (2, 4, 8)]
    printed = capsys.readouterr().out
    assert "ours/torch" in printed and "bubble" in printed


def test_benchmark_needs_two_stages(capsys):
    with pytest.raises(SystemExit) as info:
        bench_main(["pipeline", "--nproc", "1"])
    assert info.value.code == 2 and "--nproc >= 2" in capsys.readouterr().err


@needs_gpus(2)
def test_on_nccl_the_pipeline_trains_as_one_process_and_traces_its_actions():
    """The NCCL path: one batch_isend_irecv group per action, CUDA buffers, device-timed spans."""
    got = run(train_gpt, CFG, "1f1b", 4, steps=2, batch=8, nproc=2, backend="nccl", timeout=180)
    want = one_process_losses(steps=2, batch=8)
    assert got[1] == pytest.approx(want, rel=1e-4)
    fixed = run(traced_fixed, 4, "gpipe", 0.002, 0.004, nproc=2, backend="nccl", timeout=180)
    assert 0 < measured_bubble(fixed.trace) < 1
