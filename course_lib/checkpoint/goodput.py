"""How often to checkpoint (Lab 08): Young's interval, a goodput model, and a simulation
to check one against the other.

Notation of Young (1974): ``tau`` is the compute time between two checkpoints, ``C`` the
time to write one, ``M`` the mean time between failures (MTBF); we add ``R``, the time
to restart (reschedule, reload the checkpoint, warm up). All in seconds. Work done since
the last completed checkpoint is lost in a failure. Saving more often (small tau) spends
the time writing checkpoints (C / tau of it); saving less often loses more work per
failure (on average tau / 2, 1 / M failures a second). The waste C / tau + tau / (2 M)
is smallest at Young's interval

    tau* = sqrt(2 C M).

Llama 3 405B's pre-training saw 466 job interruptions in 54 days: M = 54 * 86400 / 466
= 10012 s, about 2.8 h. With a checkpoint written in C = 60 s::

    young_interval(60, 10_000)                   # sqrt(2 * 60 * 10000) = 1095 s, 18 min
    expected_goodput(1095, 60, 10_000, R=600)    # 1 - 0.055 - 0.055 - 0.06 = 0.83
    simulate(1095, 60, 10_000, 600, horizon=54 * 86400, seed=0)   # 453 failures, 0.845

(the model is first order: the terms it drops, of the order of its waste squared, are
0.012 here; a 54-day run's goodput varies by about 0.005 with its luck.)

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


def expected_goodput(tau, C, M, R=0.0):
    """The fraction of wall time spent on work that is kept, to first order in tau / M,
    C / tau and R / M (Young's model, with the restart added):

        G(tau) = 1 - C / tau - (tau / 2 + R) / M

    Each tau s of work costs C s of writing (the C / tau term); failures come 1 / M per
    second and each loses on average tau / 2 of work plus R of restart (the last term).
    dG/dtau = C / tau^2 - 1 / (2 M) = 0 gives Young's tau* = sqrt(2 C M), whatever R.
    What it leaves out: a failure while a checkpoint is written also loses the write
    (C / 2 on average), and the write's share is C / (tau + C), not C / tau; both are
    second order when C << tau << M. Below 0 where the waste passes 1: no progress."""
    _check(tau, C, M, R)
    return 1.0 - C / tau - (tau / 2 + R) / M


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


__all__ = ["young_interval", "expected_goodput", "simulate", "Simulated", "goodput_sweep"]
