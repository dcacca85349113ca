"""Running one training step of a schedule on a real pipeline of ranks.

Every rank of the pipeline group calls :func:`pipeline_step` with its own
:class:`~course_lib.pipeline.stage.PipelineStage` and the same schedule::

    stage = PipelineStage(gpt_stage(cfg, s, p), s, p, group=pp_group)
    opt.zero_grad()
    loss = pipeline_step(stage, one_f_one_b(p, m), batch=x if s == 0 else None,
                         targets=y if s == p - 1 else None, loss_fn=loss_fn)
    opt.step()             # loss: the mean loss on the last stage, None elsewhere

Stage 0 cuts the batch into m microbatches (``tensor_split``: when m does not
divide the batch the first ones get one row more, and each microbatch's loss
is weighted by its share of the rows, so the accumulated gradients are those
of the full-batch mean loss, for a ``loss_fn`` that is a mean over rows). The
stage then runs its actions in order: F(mb) takes the microbatch (stage 0) or
the activation from stage s-1, B(mb) the gradient from stage s+1. Naive model
parallelism is the same step with m = 1.

Messages go through :func:`course_lib.comm.exchange_async`, counted, untagged: a link
carries the header and activations one way and gradients the other, and each way's
messages are matched in the order both ends post them, as NCCL matches them (it has
no tags; under its rules a tag is refused). After each
action one exchange posts that action's sends *together with* the receives the
next action needs (Megatron's send-forward-recv-backward pairing), and the next
action waits for it. On NCCL each exchange is one ``batch_isend_irecv`` group,
and waiting on it makes the GPU stream wait, not the host. Why that cannot
deadlock on NCCL, which matches by posting order: both ends of
a link post its messages in the same order (``validate`` checks that F and B
run in the same microbatch order on neighbouring stages), and before running a
schedule the executor checks it with
:func:`~course_lib.pipeline.validate.deadlock` under the rendezvous rule (a
send completes only once its receive is posted), which models exactly this
posting pattern. GPipe, 1F1B and ZB-H1's order pass. On gloo a wait blocks the
host, and waiting for a send means waiting for the neighbour to reach its
receive; so there the sends are posted on their own and waited for at the end
of the step (their tensors are never reused), and an action waits only for its
inputs, as the simulation assumes.

Receivers need shapes. At the start of each step a small header travels down
the pipeline (rows in the batch, m, and the sender's output dtype and shape
after the rows); stage s learns its own output's shape once per input shape,
with one forward of a one-row zero input without gradients. So stages may
change the shape (tokens in, (B, T, D) between, logits out); a stage's output
must keep the microbatch's rows as its first dimension.

A span per action (``F3``, ``B3``: category ``compute``, with the microbatch,
stage, kind and step) feeds the timeline, and the messages leave ``comm`` spans
unless the stage says ``trace_messages=False``; untraced runs take the same path.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from course_lib import comm, trace
from course_lib.pipeline.validate import as_actions, chunks_of, deadlock, validate
from course_lib.pipeline.stage import backward_step as _default_backward
from course_lib.pipeline.stage import forward_step as _default_forward

HEADER_LEN = 16  # rows, m, dtype code, ndim, then up to 12 dimensions
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool)
_checked = {}  # schedules already validated: (p, m, actions) -> None


def microbatch_rows(n_rows, m):
    """Rows of each of the m microbatches ``tensor_split`` cuts ``n_rows`` into."""
    if n_rows < m:
        raise ValueError(f"a batch of {n_rows} rows cannot be cut into m={m} microbatches: "
                         f"use m <= {n_rows}")
    return [n_rows // m + (i < n_rows % m) for i in range(m)]


def _check_schedule(schedule, p, m):
    key = (p, m, tuple(tuple(tuple(a) for a in row) for row in schedule))
    if key in _checked:
        return
    validate(schedule, p, m)
    if chunks_of(schedule) > 1:
        raise ValueError("the executor runs one model chunk per stage: interleaved schedules "
                         "(chunk > 0) are simulated, not executed")
    if any(a[0] == "W" for row in schedule for a in row):
        raise ValueError("the executor runs full backwards: W actions (zero bubble) are "
                         "simulated, not executed")
    stuck = deadlock(schedule, rendezvous=True)
    if stuck:
        raise ValueError(f"the executor posts each action's sends with the next action's "
                         f"receives, and this schedule would deadlock that way: {stuck}")
    _checked[key] = None


def _header(n_rows, m, dtype, tail, device):
    if dtype not in DTYPES:
        raise ValueError(f"activations of dtype {dtype} cannot be sent; use one of {DTYPES}")
    if len(tail) > HEADER_LEN - 4:
        raise ValueError(f"activations with {len(tail) + 1} dimensions: at most {HEADER_LEN - 3}")
    values = [n_rows, m, DTYPES.index(dtype), len(tail), *tail]
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64,
                        device=device)


def _read_header(header):
    values = header.tolist()
    n_rows, m, code, ndim = values[:4]
    return n_rows, m, DTYPES[code], tuple(values[4:4 + ndim])


def _output_template(stage, in_dtype, in_tail):
    """(dtype, shape after the rows) of this stage's output for such inputs."""
    key = (in_dtype, in_tail)
    if key not in stage.output_templates:
        probe = torch.zeros((1, *in_tail), dtype=in_dtype, device=stage.device)
        with torch.no_grad(), trace.paused():
            out = stage.module(probe)
        if out.shape[:1] != (1,):
            raise ValueError(f"stage {stage.stage}: its output must keep the microbatch's rows "
                             f"as the first dimension; a 1-row input gave {tuple(out.shape)}")
        stage.output_templates[key] = (out.dtype, tuple(out.shape[1:]))
    return stage.output_templates[key]


def _exchange_header(stage, batch, m):
    """Rows in the batch, (dtype, shape after the rows) of this stage's input and of its
    output (None on the last stage), and the handle of the header sent downstream.
    Stage 0 reads them off the batch; stage s > 0 receives them from stage s-1, then
    tells stage s+1 what it will send."""
    s, group = stage.stage, stage.group
    if stage.is_first:
        if batch is None:
            raise ValueError("stage 0 needs the batch: pipeline_step(stage, schedule, batch=...)")
        n_rows, incoming = batch.shape[0], (batch.dtype, tuple(batch.shape[1:]))
    else:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=stage.device)
        with _messages_traced(stage):
            comm.exchange(recvs=[(header, stage.prev)], group=group)
        n_rows, sent_m, dtype, tail = _read_header(header)
        if sent_m != m:
            raise ValueError(f"stage {s} runs a schedule of m={m} microbatches but stage 0 "
                             f"cut the batch into {sent_m}")
        incoming = (dtype, tail)
    microbatch_rows(n_rows, m)  # refuse too few rows before anything more is sent
    if stage.is_last:
        return n_rows, incoming, (None, None), None
    outgoing = _output_template(stage, *incoming)
    with _messages_traced(stage):
        sent = comm.exchange_async(
            sends=[(_header(n_rows, m, *outgoing, stage.device), stage.next)],
            group=group)
    return n_rows, incoming, outgoing, sent


def _messages_traced(stage):
    """Record this stage's messages in the trace (the default), or not."""
    return nullcontext() if stage.trace_messages else trace.paused()


class _Tracker:
    """Microbatches in flight on this stage (and the bytes autograd saved for them)."""

    def __init__(self, stage):
        self.stage, self.peak, self.bytes_now, self.bytes_peak = stage, 0, 0, 0
        self.by_microbatch = {}
        self.params = {p.untyped_storage().data_ptr() for p in stage.module.parameters()}

    def forward(self, fwd, stage, microbatch, *args):
        """``fwd(stage, microbatch, *args)``, counting what autograd saves while it runs."""
        if not self.stage.measure_activations:
            return fwd(stage, microbatch, *args)
        saved, seen = [0], set()

        def pack(t):
            # a view's own bytes (a microbatch is a view of the whole batch), each tensor
            # once; parameters and views of them are model state, not activations
            key = (t.data_ptr(), t.numel(), t.dtype)
            if t.untyped_storage().data_ptr() not in self.params and key not in seen:
                seen.add(key)
                saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fwd(stage, microbatch, *args)
        self.by_microbatch[microbatch] = saved[0]
        self.bytes_now += saved[0]
        self.bytes_peak = max(self.bytes_peak, self.bytes_now)
        return out

    def after(self, kind, microbatch):
        if kind == "F":
            self.peak = max(self.peak, len(self.stage.stash))
        else:
            self.bytes_now -= self.by_microbatch.pop(microbatch, 0)


def pipeline_step(stage, schedule, batch=None, targets=None, loss_fn=None, n_microbatches=None,
                  *, forward_step=None, backward_step=None):
    """Run this stage's part of one step of ``schedule``; gradients accumulate into
    the stage's parameters (zero them before, as before ``loss.backward()``).
    Returns the batch's mean loss on the last stage, None elsewhere.

    ``batch`` is given on stage 0, ``targets`` and ``loss_fn`` on the last stage.
    ``n_microbatches`` defaults to the schedule's. ``forward_step`` and
    ``backward_step`` replace :func:`~course_lib.pipeline.stage.forward_step` and
    :func:`~course_lib.pipeline.stage.backward_step` (Lab 04's exercise)."""
    fwd, bwd = forward_step or _default_forward, backward_step or _default_backward
    s, p = stage.stage, stage.n_stages
    if not isinstance(schedule, (list, tuple)) or len(schedule) != p:
        raise ValueError(f"stage {s}: the schedule must have one list of actions per stage "
                         f"({p}), got "
                         f"{len(schedule) if isinstance(schedule, list) else schedule!r}")
    m = n_microbatches or 1 + max((a[1] for row in schedule for a in row), default=0)
    _check_schedule(schedule, p, m)
    actions = as_actions([schedule[s]])[0]
    group, device = stage.group, stage.device
    n_rows, (in_dtype, in_tail), (out_dtype, out_tail), header_sent = _exchange_header(
        stage, batch, m)
    rows = microbatch_rows(n_rows, m)
    inputs = batch.tensor_split(m) if stage.is_first else None
    if stage.is_last:
        if targets is None or loss_fn is None:
            raise ValueError(f"the last stage ({s}) needs targets= and loss_fn=")
        if targets.shape[0] != n_rows:
            raise ValueError(f"targets have {targets.shape[0]} rows, the batch {n_rows}")
        target_mbs = targets.tensor_split(m)
    stage.loss_fn = loss_fn
    weights = [r / n_rows for r in rows]
    sends_grad = not stage.is_first and in_dtype.is_floating_point
    gets_grad = out_dtype is not None and out_dtype.is_floating_point

    # ---- the actions -------------------------------------------------------------------------
    incoming = {}

    def receives_for(action):
        kind, mb = action[0], action[1]
        if kind == "F" and not stage.is_first:
            buf = incoming[action] = torch.empty((rows[mb], *in_tail), dtype=in_dtype,
                                                 device=device)
            return [(buf, stage.prev)]
        if kind == "B" and gets_grad:
            buf = incoming[action] = torch.empty((rows[mb], *out_tail), dtype=out_dtype,
                                                 device=device)
            return [(buf, stage.next)]
        return []

    tracker = _Tracker(stage)
    loss = torch.zeros((), device=device) if stage.is_last else None
    with _messages_traced(stage):
        pending = comm.exchange_async(recvs=receives_for(actions[0]) if actions else [],
                                      group=group)
    runs_ahead = p > 1 and dist.get_backend(group) == "gloo"
    sends_in_flight = [header_sent] if header_sent is not None else []
    for i, action in enumerate(actions):
        kind, mb = action[0], action[1]
        pending.wait()  # this action's inputs are here (on NCCL, the last action's sends too)
        sends = []
        with trace.span(f"{kind}{mb}", "compute", microbatch=mb, stage=s, kind=kind,
                        step=stage.steps):
            if kind == "F":
                x = inputs[mb] if stage.is_first else incoming.pop(action)
                target = target_mbs[mb] if stage.is_last else None
                out = tracker.forward(fwd, stage, mb, x, target, weights[mb])
            else:
                out = bwd(stage, mb, incoming.pop(action) if gets_grad else None)
        tracker.after(kind, mb)
        if kind == "F" and stage.is_last:
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                raise ValueError(f"stage {s}: the forward of microbatch {mb} on the last stage "
                                 f"must return its (weighted) loss, got {_what(out)}")
            loss += out.detach().reshape(())
        elif kind == "F":
            want = (rows[mb], *out_tail)
            if (not isinstance(out, torch.Tensor) or tuple(out.shape) != want
                    or out.dtype != out_dtype):
                raise ValueError(f"stage {s}: the forward of microbatch {mb} returned "
                                 f"{_what(out)}; the next stage expects shape {want}, {out_dtype}")
            sends.append((out.detach().contiguous(), stage.next))
        elif sends_grad:
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows[mb], *in_tail):
                raise ValueError(
                    f"stage {s}: the backward of microbatch {mb} returned {_what(out)} instead of "
                    f"the gradient of its input, shape {(rows[mb], *in_tail)} (did the forward "
                    f"make the received activation require grad?)")
            sends.append((out.detach().to(in_dtype).contiguous(), stage.prev))
        nxt = receives_for(actions[i + 1]) if i + 1 < len(actions) else []
        with _messages_traced(stage):
            if runs_ahead and sends:
                sends_in_flight.append(comm.exchange_async(sends=sends, group=group))
                sends = []
            pending = comm.exchange_async(sends=sends, recvs=nxt, group=group)
    pending.wait()
    for handle in sends_in_flight:
        handle.wait()
    if stage.stash:
        left = sorted(stage.stash)
        stage.stash.clear()
        raise ValueError(f"stage {s} still holds the activations of microbatches {left} after "
                         f"the step: the backward must take each microbatch out of stage.stash")
    stage.peak_in_flight = tracker.peak
    stage.peak_activation_bytes = tracker.bytes_peak if stage.measure_activations else None
    stage.steps += 1
    return loss


def _what(value):
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, {value.dtype}"
    return repr(value) if value is None else type(value).__name__
