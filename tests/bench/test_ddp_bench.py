"""The DDP benchmark on tiny sizes: the GPT model option (GPT-2 small's shape, shrunk
here through ``gpt``) builds its variants, the hook-cost figure (our per-parameter hooks
with no collective, against a plain backward) comes out in the result and in the CLI's
output. No assertion on time beyond "a positive number"."""
import math
import re
import sys

import pytest

from conftest import run_bench, ship_by_value
from course_lib import run
from course_lib.bench import ddp as bd
from course_lib.bench import ddp_hooks as bdh
from course_lib.models import GPT, GPTConfig

ship_by_value(__name__)

TINY_GPT = dict(vocab=64, dim=32, layers=2, heads=4, seq_len=16)
GPT_SHAPE = dict(model="gpt2-small", gpt=TINY_GPT, seq=16, batch=2)
COST_KEYS = {"tensors", "plain_backward_s", "ours_s", "ours_per_tensor_s", "torch_s",
             "torch_per_tensor_s", "ours_host_per_tensor_s"}


def test_gpt2_small_is_gpt2_small_shape_and_is_described():
    work = bd._Workload("gpt2-small", batch=2, seq=128)
    c = work.config
    assert (c.vocab, c.dim, c.layers, c.heads, c.seq_len) == (50257, 768, 12, 12, 1024)
    line = bd.describe("gpt2-small", batch=2, seq=128)
    assert "163.1M parameters, 138 tensors" in line and "batch 2 x 128 tokens" in line
    # the tensor count describe gives (without building 163M parameters) is the model's
    tiny = bd._Workload(**GPT_SHAPE).config
    assert f"{len(list(GPT(tiny).parameters()))} tensors" in bd.describe(**GPT_SHAPE)
    with pytest.raises(ValueError, match="model must be one of"):
        bd._Workload("gpt3")


def test_gpt_model_runs_compute_ours_and_torch_side_by_side():
    times = run(bd.measure, steps=1, rounds=1, warmup=1, nproc=2, timeout=300, **GPT_SHAPE)
    assert times[0] == times[1]  # every rank reports the slowest rank's view
    assert set(times[0]) == {"compute only", "DDP (ours)", "torch DDP"}
    assert all(t > 0 for t in times[0].values())
    assert run(bd.traced_overlap, nproc=2, timeout=300, **GPT_SHAPE)[0] >= 1


@pytest.mark.parametrize("shape", [GPT_SHAPE, dict(width=32, depth=3, batch=4)],
                         ids=["gpt", "mlp"])
def test_hook_cost_is_a_positive_figure_per_parameter_tensor(shape):
    cost = run(bdh.hook_cost, steps=5, rounds=3, nproc=2, timeout=300, **shape)
    assert cost[0] == cost[1]
    cost = cost[0]
    assert set(cost) == COST_KEYS
    expected = 11 * TINY_GPT["layers"] + 6 if shape.get("model") else 2 * (3 + 1)
    assert cost["tensors"] == expected
    assert cost["ours_per_tensor_s"] > 0 and cost["ours_host_per_tensor_s"] > 0
    assert cost["ours_per_tensor_s"] == pytest.approx(cost["ours_s"] / cost["tensors"])
    assert math.isfinite(cost["torch_per_tensor_s"]) and cost["plain_backward_s"] > 0
    line = bdh.format_hook_cost(cost).splitlines()[0]
    assert re.fullmatch(rf"our hooks: [\d.]+ us per parameter tensor \({expected} tensors\), "
                        r"[\d.]+ ms per step", line)


@pytest.mark.slow
def test_cli_prints_the_hook_cost_and_returns_it(tmp_path):
    proc, result = run_bench(tmp_path, "ddp", "--nproc", 2, "--width", 32, "--depth", 2,
                             "--batch", 4, "--sweep", 1, "--steps", 3, "--rounds", 2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert result["model"] == "mlp" and set(result["hook_cost"]) == COST_KEYS
    cost = result["hook_cost"]
    # six paired steps: the extra time may come out at noise level; the host time may not
    assert cost["tensors"] == 6 and cost["ours_host_per_tensor_s"] > 0
    assert math.isfinite(cost["ours_per_tensor_s"])
    assert {"NaiveDDP", "FlatDDP", "DDP (ours)", "torch DDP"} <= set(result["step_s"])
    assert re.search(r"our hooks: -?[\d.]+ us per parameter tensor \(6 tensors\)", proc.stdout)
    assert "model: mlp 32 x 2 + 1" in proc.stdout


def test_cli_refuses_seq_for_the_mlp(capsys):
    from course_lib.bench.__main__ import main

    with pytest.raises(SystemExit):
        main(["ddp", "--seq", "16"])
    assert "--seq is for --model gpt2-small" in capsys.readouterr().err
