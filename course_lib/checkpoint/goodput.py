"""How often to checkpoint (Lab 08): Young's interval, a goodput model, and a simulation
to check one against the other.

Notation of Young (1974): ``tau`` is the compute time between two checkpoints, ``C`` the
time to write one, ``M`` the mean time between failures (MTBF); we add ``R``, the time
to restart (reschedule, reload the checkpoint, warm up). All in seconds. Work done since
the last completed checkpoint is lost in a failure. The job runs cycles of tau s of work
and C s of writing: C / (tau + C) of its time goes to writing, and a failure (1 / M a
second) loses on average half a cycle, (tau + C) / 2, plus the restart. The waste
C / (tau + C) + (tau + C) / (2 M) is smallest at Daly's first-order interval (2006)

    tau* = sqrt(2 C M) - C,

and Young's sqrt(2 C M), which counts the writing as C / tau, is the same to first order
in C / M (both are "first order"; the exact optimum of this process lies between them).

Llama 3 405B's pre-training saw 466 interruptions in 54 days, 47 of them planned: the 419
unexpected ones give M = 54 * 86400 / 419 = 11135 s, about 3.1 h. With a checkpoint
written in C = 60 s::

    young_interval(60, 11_135)                   # sqrt(2 * 60 * 11135) = 1156 s, 19 min
    daly_interval(60, 11_135)                    # 1156 - 60 = 1096 s
    expected_goodput(1096, 60, 11_135, R=600)    # 0.948 * (1 - 0.052 - 0.054) = 0.848
    simulate(1096, 60, 11_135, 600, horizon=54 * 86400, seed=0).goodput   # 0.860

(the model is first order in (tau + C) / M and R / M: against the exact expectation of
the simulated process, 0.853, it is off by 0.005 here; a 54-day run's goodput varies by
about 0.005 with its luck.)

:func:`goodput_sweep` gives a notebook the arrays for a plot of goodput against tau
(this module imports no plotting library).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


def _positive(**values):
    for name, value in values.items():
        if not value > 0:  # also refuses NaN
            raise ValueError(f"{name} must be > 0 seconds, got {value!r}")


def _check(tau, C, M, R):
    _positive(tau=tau, C=C, M=M)
    if not R >= 0:
        raise ValueError(f"R (the restart time) must be >= 0 seconds, got {R!r}")


def young_interval(C, M):
    """Young's optimal compute time between checkpoints, tau* = sqrt(2 C M) (s), for a
    checkpoint that takes ``C`` s to write and a mean time between failures ``M`` s."""
    _positive(C=C, M=M)
    return math.sqrt(2 * C * M)


def daly_interval(C, M):
    """Daly's first-order interval, tau* = sqrt(2 C M) - C (s): the minimum of the waste
    C / (tau + C) + (tau + C) / (2 M), where the cycle tau + C, not tau, is what a write
    shares its time with and a failure loses half of. For C < M / 2 (otherwise there is
    no interval worth saving at)."""
    _positive(C=C, M=M)
    if not C < M / 2:
        raise ValueError(f"C must be < M / 2 for a checkpoint to pay, got C = {C!r}, M = {M!r}")
    return math.sqrt(2 * C * M) - C


def expected_goodput(tau, C, M, R=0.0):
    """The fraction of wall time spent on work that is kept, to first order in
    (tau + C) / M and R / M:

        G(tau) = tau / (tau + C) * (1 - ((tau + C) / 2 + R) / M)

    Failures come 1 / M per second of wall time; each loses on average half a cycle,
    (tau + C) / 2 (the work since the last checkpoint and the write it interrupts), and
    R of restart; of the time left, a cycle's tau / (tau + C) is work. Its maximum is at
    tau = sqrt(2 C (M - R)) - C: Daly's interval when R = 0, Young's to first order.
    What it leaves out: failures during a restart and the chance that two land in one
    cycle, terms of the order of its waste squared. Below 0 where the waste passes 1."""
    _check(tau, C, M, R)
    return tau / (tau + C) * (1.0 - ((tau + C) / 2 + R) / M)


@dataclass
class Simulated:
    """One simulated run: ``goodput`` = ``useful`` / ``horizon``; ``useful``: work covered
    by a completed checkpoint; ``lost``: work done and then lost to a failure;
    ``restarting``: time spent restarting (cut short where a failure interrupts it); all
    in s. The rest of the horizon went to writing checkpoints (C each, and parts of writes
    a failure interrupted) and to work the horizon ended before saving."""
    goodput: float
    failures: int
    checkpoints: int
    useful: float
    lost: float
    restarting: float
    horizon: float


def simulate(tau, C, M, R, horizon, seed):
    """Run the schedule "tau s of work, C s writing a checkpoint" for ``horizon`` s of wall
    time, with failures at the arrivals of a Poisson process of rate 1 / M (independent
    exponential gaps of mean M, drawn by ``random.Random(seed)``: the same seed gives the
    same failure times, whatever tau). A failure loses the work since the last completed
    checkpoint (a write it interrupts does not count) and starts a restart of R s; a
    failure during a restart starts it again. Work not yet covered by a checkpoint when
    the horizon ends is counted neither useful nor lost."""
    _check(tau, C, M, R)
    _positive(horizon=horizon)
    draws = random.Random(seed)
    cycle = tau + C
    useful = lost = restarting = 0.0
    failures = checkpoints = 0
    start = 0.0  # when the job (re)starts computing from its last checkpoint
    failure = draws.expovariate(1.0 / M)
    # one step per failure, not per checkpoint: between two failures the job completes
    # floor(gap / cycle) cycles, so a long horizon at a small tau costs no more
    while True:
        end = min(failure, horizon)
        if failures:  # the last failure's restart ran from start - R to start, or to end
            restarting += min(start, end) - (start - R)
        if end > start:
            done = math.floor((end - start) / cycle)
            checkpoints += done
            useful += done * tau
            if failure <= horizon:
                # the write in progress, if any, is wasted too, but it is not work
                lost += max(0.0, min(end - start - done * cycle, tau))
        if failure > horizon:
            break
        failures += 1
        start = failure + R  # a failure before this restarts the restart (end <= start)
        failure += draws.expovariate(1.0 / M)
    return Simulated(useful / horizon, failures, checkpoints, useful, lost, restarting, horizon)


def goodput_sweep(C, M, R=0.0, horizon=None, seed=0, taus=None, points=25):
    """Model and simulation over a range of intervals, for a plot: a dict of numpy arrays
    ``tau``, ``model``, ``simulated``, ``failures`` and the floats ``young`` (tau*) and
    ``best`` (the tau of the highest simulated goodput). ``taus`` default: ``points``
    intervals from tau* / 8 to 8 tau*, evenly spaced in log; ``horizon`` default: 10 000 M
    (about 10 000 failures). Every tau sees the same failure times (one ``seed``): the
    curves differ by the schedule, not by luck::

        sweep = goodput_sweep(C=60, M=10_000, R=600)
        plt.semilogx(sweep["tau"], sweep["simulated"], "o", sweep["tau"], sweep["model"])
        plt.axvline(sweep["young"])
    """
    import numpy as np  # here, not at import: the library needs it only for the plot

    young = young_interval(C, M)
    horizon = 10_000 * M if horizon is None else horizon
    if taus is None:
        taus = young * np.logspace(-math.log10(8), math.log10(8), points)
    taus = np.asarray(taus, dtype=float)
    runs = [simulate(t, C, M, R, horizon, seed) for t in taus]
    simulated = np.array([r.goodput for r in runs])
    return {"tau": taus, "model": np.array([expected_goodput(t, C, M, R) for t in taus]),
            "simulated": simulated, "failures": np.array([r.failures for r in runs]),
            "young": young, "best": float(taus[int(np.argmax(simulated))])}


__all__ = ["young_interval", "daly_interval", "expected_goodput", "simulate", "Simulated", "goodput_sweep"]
