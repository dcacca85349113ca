"""The executor under real torchrun (gloo) against one process training the whole model
on the whole batch. One launch per world size runs every case; the reference is computed
here, in the test process."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conftest import ship_by_value
from course_lib import LaunchError, LaunchTimeout, comm, run
from course_lib.models import GPT, GPTConfig
from course_lib.pipeline import (Action, FixedTimeStage, PipelineStage, gpipe, gpt_stage,
                                 make_schedule, measured_bubble, measured_timeline, mlp_stage,
                                 one_f_one_b, partition, peak_in_flight, pipeline_step,
                                 uneven_mlp)
from course_lib.pipeline.executor import HEADER_LEN, microbatch_rows

ship_by_value(__name__)

SIZES = [13, 40, 7, 29, 11, 5]  # every boundary changes the width
MLP_ROWS = 11  # divides by none of the m below but 1
CFG = GPTConfig(vocab=29, dim=16, layers=2, heads=2, seq_len=8)  # 4 pieces: up to 4 stages
GPT_ROWS = 9
STEPS = 2
TIMEOUT = 240


def _data(kind):
    gen = torch.Generator().manual_seed(3)
    if kind == "mlp":
        return torch.randn(MLP_ROWS, SIZES[0], generator=gen), torch.randn(MLP_ROWS, SIZES[-1],
                                                                           generator=gen)
    x = torch.randint(0, CFG.vocab, (GPT_ROWS, CFG.seq_len), generator=gen)
    return x, torch.randint(0, CFG.vocab, (GPT_ROWS, CFG.seq_len), generator=gen)


def _loss(kind):
    if kind == "mlp":
        return F.mse_loss
    return lambda logits, y: F.cross_entropy(logits.reshape(-1, CFG.vocab), y.reshape(-1))


def _optimizer(kind, params):
    if kind == "mlp":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _stage_module(kind, s, p):
    if kind == "mlp":
        return mlp_stage(SIZES, partition([1] * (2 * len(SIZES) - 3), p)[s])
    return gpt_stage(CFG, s, p)


def single_process(kind):
    model = uneven_mlp(SIZES) if kind == "mlp" else GPT(CFG, seed=0)
    opt = _optimizer(kind, model.parameters())
    x, y = _data(kind)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _loss(kind)(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def train(cases, group_size=None):
    """Every (model, schedule, m) case for STEPS steps on this rank's stage. With
    ``group_size`` the world is cut into pipelines of that many ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group, p, s = None, world, rank
    if group_size:
        p, s = group_size, rank % group_size
        groups = [dist.new_group(list(range(g, g + p))) for g in range(0, world, p)]
        group = groups[rank // p]
    out = []
    for kind, schedule_kind, m in cases:
        module = _stage_module(kind, s, p)
        stage = PipelineStage(module, s, p, group=group)
        opt = _optimizer(kind, module.parameters())
        x, y = _data(kind)
        schedule = make_schedule(schedule_kind, p, m)
        losses, counts = [], None
        for _ in range(STEPS):
            opt.zero_grad()
            with comm.counting() as stats:
                loss = pipeline_step(stage, schedule, batch=x if s == 0 else None,
                                     targets=y if s == p - 1 else None, loss_fn=_loss(kind))
            opt.step()
            losses.append(None if loss is None else loss.item())
            counts = counts or (stats.sent_to.copy(), stats.sent_messages)
        out.append({"state": module.state_dict(), "peak": stage.peak_in_flight, "losses": losses,
                    "sent_to": dict(counts[0]), "messages": counts[1]})
    return out


def _cases(p):
    ms = sorted({1, p - 1, p, 2 * p + 1} - {0})
    return [(kind, sched, m) for kind in ("mlp", "gpt") for sched in ("gpipe", "1f1b") for m in ms]


def _expected_bytes(kind, s, p, m):
    """(bytes to stage s+1, bytes to stage s-1) in one step: the header and every
    microbatch's activation forward, every microbatch's input gradient back."""
    def width(stage):  # features per row leaving stage `stage`
        if kind == "mlp":
            last = partition([1] * (2 * len(SIZES) - 3), p)[stage][-1]
            return SIZES[last // 2 + 1]
        return CFG.seq_len * CFG.dim
    rows = MLP_ROWS if kind == "mlp" else GPT_ROWS
    forward = 8 * HEADER_LEN + 4 * rows * width(s) if s < p - 1 else 0
    backward = 4 * rows * width(s - 1) if s > 0 else 0
    return forward, backward


@pytest.mark.parametrize("p", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_pipeline_trains_as_one_process_on_the_whole_batch(p):
    want = {kind: single_process(kind) for kind in ("mlp", "gpt")}
    cases = _cases(p)
    outs = run(train, cases, nproc=p, timeout=TIMEOUT)
    for c, (kind, schedule_kind, m) in enumerate(cases):
        state, losses = want[kind]
        peaks = peak_in_flight(make_schedule(schedule_kind, p, m))
        for s in range(p):
            got = outs[s][c]
            where = f"{kind} {schedule_kind} p={p} m={m} stage {s}"
            assert got["state"].keys() <= state.keys() and got["state"], where
            for name, tensor in got["state"].items():
                torch.testing.assert_close(tensor, state[name], rtol=1e-5, atol=1e-6,
                                           msg=f"{where}: {name}")
            assert got["peak"] == peaks[s], where
            forward, backward = _expected_bytes(kind, s, p, m)
            assert got["sent_to"].get(s + 1, 0) == forward, where
            assert got["sent_to"].get(s - 1, 0) == backward, where
            assert got["messages"] == (1 + m if s < p - 1 else 0) + (m if s > 0 else 0), where
        # the mean loss of the whole batch, before each step
        assert outs[p - 1][c]["losses"] == pytest.approx(losses, rel=1e-5)
        assert all(o[c]["losses"] == [None] * STEPS for o in outs[:p - 1])
        names = set().union(*(outs[s][c]["state"] for s in range(p)))
        assert names == set(state), f"the stages together hold every parameter once ({kind})"


def test_two_pipelines_on_sub_groups_use_group_local_ranks():
    want, _ = single_process("gpt")
    outs = run(train, [("gpt", "1f1b", 3)], group_size=2, nproc=4, timeout=TIMEOUT)
    for rank in range(4):
        got = outs[rank][0]
        for name, tensor in got["state"].items():
            torch.testing.assert_close(tensor, want[name], rtol=1e-5, atol=1e-6)
        # peers named by their rank in the pipeline group: 0 and 1, never 2 or 3
        assert set(got["sent_to"]) == {1 - rank % 2}


def traced(schedule_kind, m, t_f=0.004, t_b=0.008):
    """A traced step of fixed-time stages (after an untraced one), and the activation
    bytes a real MLP stage holds at its peak under the same schedule."""
    s, p = dist.get_rank(), dist.get_world_size()
    schedule = make_schedule(schedule_kind, p, m)
    stage = PipelineStage(FixedTimeStage(t_f, t_b), s, p)
    x = torch.ones(2 * m, 3)
    args = dict(batch=x if s == 0 else None, targets=x if s == p - 1 else None,
                loss_fn=F.mse_loss)
    from course_lib import trace
    with trace.paused():
        pipeline_step(stage, schedule, **args)
    dist.barrier()
    pipeline_step(stage, schedule, **args)
    mlp = PipelineStage(mlp_stage([8] * (p + 1), range(2 * s, 2 * s + 1)), s, p,
                        measure_activations=True)
    batch = torch.randn(4 * m, 8)
    pipeline_step(mlp, schedule, batch=batch if s == 0 else None,
                  targets=batch if s == p - 1 else None, loss_fn=F.mse_loss)
    return mlp.peak_activation_bytes


def test_spans_per_action_follow_the_schedule_and_activation_bytes_follow_in_flight():
    p, m = 3, 5
    bytes_held = {}
    for kind in ("gpipe", "1f1b"):
        result = run(traced, kind, m, nproc=p, timeout=TIMEOUT)
        timeline = measured_timeline(result.trace)
        schedule = make_schedule(kind, p, m)
        for s in range(p):
            assert [a for a, _, _ in timeline[s]] == schedule[s]  # order as scheduled
            assert all(t1 > t0 for _, t0, t1 in timeline[s])
        labels = {sp.microbatch for sp in result.trace.select(cat="compute")
                  if sp.args.get("kind")}
        assert labels == set(range(m))
        assert 0.0 < measured_bubble(result.trace) < 1.0  # its value is measured, not asserted
        bytes_held[kind] = list(result)
    for s in range(p):
        # a 8 -> 8 Linear keeps its input (4 rows x 8 floats per microbatch); the last stage
        # also the loss's operands
        assert bytes_held["gpipe"][s] > bytes_held["1f1b"][s] > 0
        if s < p - 1:
            per_microbatch = 4 * 8 * 4
            assert bytes_held["gpipe"][s] == m * per_microbatch
            assert bytes_held["1f1b"][s] == min(m, p - s) * per_microbatch


class Exploding(nn.Module):
    def forward(self, x):
        raise RuntimeError("stage 1 blew up on purpose")


def exploding_job():
    s, p = dist.get_rank(), dist.get_world_size()
    module = Exploding() if s == 1 else nn.Linear(4, 4)
    stage = PipelineStage(module, s, p)
    x = torch.randn(6, 4)
    pipeline_step(stage, one_f_one_b(p, 3), batch=x if s == 0 else None,
                  targets=x if s == p - 1 else None, loss_fn=F.mse_loss)


def test_a_stage_that_raises_surfaces_its_traceback_not_a_hang():
    with pytest.raises(LaunchError) as info:
        run(exploding_job, nproc=3, timeout=60)
    assert not isinstance(info.value, LaunchTimeout)  # its neighbours did not hang
    # rank 1's own error is reported (its neighbours' "connection closed" may be too)
    (own,) = [e for e in info.value.errors if e["rank"] == 1]
    assert own["type"] == "RuntimeError" and "stage 1 blew up on purpose" in own["message"]
    assert "in forward" in own["traceback"]


# ---- one stage: no process group needed, so bad inputs are tested in this process -------------
def _one_stage():
    return PipelineStage(nn.Linear(3, 2), 0, 1)


def test_one_stage_accumulates_microbatches_to_the_full_batch_gradient():
    torch.manual_seed(0)
    x, y = torch.randn(7, 3), torch.randn(7, 2)
    stage = _one_stage()
    ref = nn.Linear(3, 2)
    ref.load_state_dict(stage.module.state_dict())
    F.mse_loss(ref(x), y).backward()
    loss = pipeline_step(stage, one_f_one_b(1, 3), batch=x, targets=y, loss_fn=F.mse_loss)
    assert loss.item() == pytest.approx(F.mse_loss(ref(x), y).item(), rel=1e-6)
    for got, want in zip(stage.module.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7)
    assert microbatch_rows(7, 3) == [3, 2, 2]
    assert stage.peak_in_flight == 1 and stage.stash == {}


@pytest.mark.parametrize("kwargs,message", [
    (dict(schedule=gpipe(1, 8), batch=torch.randn(5, 3)), "5 rows cannot be cut into m=8"),
    (dict(schedule=gpipe(2, 2), batch=torch.randn(4, 3)), "one list of actions per stage"),
    (dict(schedule=[[Action("B", 0), Action("F", 0)]], batch=torch.randn(4, 3)),
     "B0 runs before F0"),
    (dict(schedule=gpipe(1, 2)), "stage 0 needs the batch"),
    (dict(schedule=gpipe(1, 2), batch=torch.randn(4, 3), targets=None), "needs targets"),
    (dict(schedule=gpipe(1, 2), batch=torch.randn(4, 3), targets=torch.randn(3, 2)),
     "targets have 3 rows, the batch 4"),
    (dict(schedule=[[Action("F", 0), Action("B", 0), Action("W", 0)]], batch=torch.randn(4, 3)),
     "W actions"),
])
def test_bad_inputs_get_a_clear_error(kwargs, message):
    kwargs.setdefault("targets", torch.randn(4, 2))
    with pytest.raises(ValueError, match=message):
        pipeline_step(_one_stage(), loss_fn=F.mse_loss, **kwargs)


def test_a_stage_must_be_its_group_rank():
    with pytest.raises(ValueError, match="stage must be in"):
        PipelineStage(nn.Linear(2, 2), 2, 2)
    with pytest.raises(ValueError, match="needs an initialised process group"):
        PipelineStage(nn.Linear(2, 2), 0, 2)
