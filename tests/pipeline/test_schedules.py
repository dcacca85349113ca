"""Schedules as data: their properties for many (p, m), validate's messages, the simulator."""
import itertools

import pytest

from course_lib.pipeline import (Action, bubble_fraction, deadlock, gpipe, interleaved_1f1b,
                                 make_schedule, naive, one_f_one_b, peak_in_flight, simulate,
                                 validate, zb_h1, zb_h1_bubble)

F, B, W = (lambda mb, c=0: Action("F", mb, c)), (lambda mb, c=0: Action("B", mb, c)), \
    (lambda mb: Action("W", mb))
SIZES = [(p, m) for p in range(1, 7) for m in range(1, 15)]  # m < p, m = 1, m = p, m > p


@pytest.mark.parametrize("build", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(build):
    for p, m in SIZES:
        schedule = build(p, m)
        validate(schedule, p, m)
        for t_f, t_b in ((1.0, 2.0), (1.0, 1.0), (0.5, 3.0)):
            bubble = simulate(schedule, t_f, t_b).bubble
            assert bubble == pytest.approx(bubble_fraction(p, m)), (p, m)


def test_in_flight_is_m_for_gpipe_and_min_m_p_minus_s_for_1f1b():
    for p, m in SIZES:
        assert peak_in_flight(gpipe(p, m)) == [m] * p
        assert peak_in_flight(one_f_one_b(p, m)) == [min(m, p - s) for s in range(p)]


def test_1f1b_shape_warmup_steady_cooldown():
    sched = one_f_one_b(4, 6)
    assert sched[0][:4] == [F(0), F(1), F(2), F(3)]  # p - s - 1 = 3 warm-up forwards, then F3 B0
    assert sched[0][4] == B(0) and sched[0][-3:] == [B(3), B(4), B(5)]
    assert sched[3][:4] == [F(0), B(0), F(1), B(1)]  # the last stage alternates at once
    assert sched[1][:3] == [F(0), F(1), F(2)] and sched[1][3] == B(0)


def test_naive_is_one_microbatch_and_leaves_each_stage_idle_most_of_the_time():
    for p in range(1, 6):
        sim = simulate(naive(p))
        assert sim.bubble == pytest.approx((p - 1) / p)
        assert sim.makespan == pytest.approx(3.0 * p)


def test_gpipe_timeline_by_hand():
    sim = simulate(gpipe(2, 2), t_f=1.0, t_b=2.0)
    assert sim.timeline[0] == [(F(0), 0, 1), (F(1), 1, 2), (B(0), 5, 7), (B(1), 7, 9)]
    assert sim.timeline[1] == [(F(0), 1, 2), (F(1), 2, 3), (B(0), 3, 5), (B(1), 5, 7)]
    assert sim.makespan == 9 and sim.busy == [6, 6]


def test_communication_time_delays_each_crossing():
    sim = simulate(gpipe(3, 1), t_f=1.0, t_b=2.0, t_comm=0.5)
    assert sim.start_of(2, F(0)) == pytest.approx(3.0)  # two hops of 1 + 0.5
    assert sim.makespan == pytest.approx(3 * 3.0 + 4 * 0.5)


def test_interleaved_bubble_is_v_times_smaller():
    for p, v in itertools.product(range(2, 6), range(1, 5)):
        for m in (p, 2 * p, 3 * p):
            sched = interleaved_1f1b(p, m, v)
            validate(sched, p, m)
            assert simulate(sched).bubble == pytest.approx(bubble_fraction(p, m, v)), (p, m, v)
            if v > 1:
                assert {a.chunk for a in sched[0]} == set(range(v))
    with pytest.raises(ValueError, match="multiple of p"):
        interleaved_1f1b(4, 6, 2)


def test_zb_h1_has_a_third_of_1f1b_bubble_at_the_same_peak():
    for p in range(2, 7):
        for m in range(p, 3 * p):
            sched = zb_h1(p, m)
            validate(sched, p, m)
            sim = simulate(sched, t_f=1.0, t_b=2.0, t_w=1.0)
            assert sim.bubble == pytest.approx(zb_h1_bubble(p, m))
            idle = sim.makespan * p - sum(sim.busy)
            one_f = simulate(one_f_one_b(p, m))
            assert idle == pytest.approx((one_f.makespan * p - sum(one_f.busy)) / 3)
            assert max(peak_in_flight(sched)) <= p


def test_make_schedule_by_name():
    assert make_schedule("gpipe", 3, 4) == gpipe(3, 4)
    assert make_schedule("naive", 3, 9) == gpipe(3, 1)
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        make_schedule("pipedream", 2, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            gpipe(bad, 2)


# ---- validate: each kind of violation is named ------------------------------------------------
def _swap(schedule, stage, i, j):
    out = [list(row) for row in schedule]
    out[stage][i], out[stage][j] = out[stage][j], out[stage][i]
    return out


@pytest.mark.parametrize("schedule,p,m,message", [
    (gpipe(2, 2)[:1], 2, 2, "list of 2 lists"),
    ([[F(0), B(0)], [F(0), ("X", 0, 0)]], 2, 1, r"stage 1, position 1: .* is not an Action"),
    ([[F(0), B(0)], [F(0), B(3)]], 2, 1, r"names microbatch 3, outside \[0, 1\)"),
    ([[F(0), F(0), B(0)], [F(0), B(0)]], 2, 1, r"stage 0: F0 runs twice \(positions 0 and 1\)"),
    ([[F(0), B(0)], [F(0), B(0)]], 2, 2, "stage 0: F1 never runs"),
    ([[F(0), B(0), F(1)], [F(0), B(0), F(1), B(1)]], 2, 2, "stage 0: B1 never runs"),
    ([[B(0), F(0)], [F(0), B(0)]], 2, 1, r"stage 0, position 0: B0 runs before F0"),
    (_swap(gpipe(3, 2), 1, 0, 1), 3, 2, r"stage 1 runs F1 where stage 0 sent F0's activation"),
    (_swap(gpipe(3, 2), 0, 2, 3), 3, 2, r"stage 0 runs B1 where stage 1 sent B0's gradient"),
    ([[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]], 2, 2,
     "deadlocks: stage 0 waits before B0 for B0's gradient from stage 1; stage 1 waits before "
     "F1 for F1's activation from stage 0"),
    ([[F(0), B(0), W(0)], [F(0), B(0)]], 2, 1, "stage 1: W0 never runs"),
    ([[F(0), W(0), B(0)], [F(0), B(0), W(0)]], 2, 1, "W0 runs before B0"),
])
def test_validate_names_the_first_violation(schedule, p, m, message):
    with pytest.raises(ValueError, match=message):
        validate(schedule, p, m)


def test_every_reordering_of_a_valid_schedule_is_either_valid_or_refused_with_a_reason():
    """Exhaustively for p=2, m=2: validate accepts exactly the orders that respect the
    dependencies, and simulate agrees (it runs what validate accepts)."""
    actions = [F(0), F(1), B(0), B(1)]
    accepted = 0
    for order0 in itertools.permutations(actions):
        for order1 in itertools.permutations(actions):
            sched = [list(order0), list(order1)]
            try:
                validate(sched, 2, 2)
            except ValueError as exc:
                assert str(exc)
                continue
            accepted += 1
            sim = simulate(sched)
            assert sim.bubble >= bubble_fraction(2, 2) - 1e-12  # nothing beats the flush bound
    assert accepted >= 2  # GPipe and 1F1B at least


def test_the_executor_protocol_accepts_gpipe_1f1b_and_zb_h1_order():
    for p, m in SIZES:
        for build in (gpipe, one_f_one_b, zb_h1):
            assert deadlock(build(p, m), rendezvous=True) is None, (build.__name__, p, m)
    # Megatron's interleaved schedule needs its own posting pattern (forward receives posted
    # ahead): under "sends with the next action's receives" it deadlocks, which the check says
    assert deadlock(interleaved_1f1b(2, 4, 2)) is None
    assert "waits" in deadlock(interleaved_1f1b(2, 4, 2), rendezvous=True)


def test_peak_in_flight_counts_until_w_when_backward_is_split():
    assert peak_in_flight([[F(0), F(1), B(0), B(1), W(0), W(1)]]) == [2]
    assert peak_in_flight([[F(0), B(0), W(0), F(1), B(1), W(1)]]) == [1]
