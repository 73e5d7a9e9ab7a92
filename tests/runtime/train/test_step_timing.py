"""The arithmetic of a step's measured figures: the wait ratio and imbalance from every rank's busy time, and
the exposed share of communication events (numerator and denominator over the same events)."""

import threading
import time

import pytest

from grstack.runtime.train.balance import measured_balance
from grstack.runtime.train.timing import CommClock, exposure

pytestmark = pytest.mark.unit


def test_measured_balance_is_the_share_of_rank_time_spent_waiting_for_the_slowest_rank():
    # ranks busy 0.1, 0.2, 0.4 s: they wait 0.3, 0.2 and 0 s for the slowest, out of 3 x 0.4 rank-seconds
    got = measured_balance([0.1, 0.2, 0.4])
    assert got["busy_ms_max"] == pytest.approx(400.0)
    assert got["wait_ratio_measured"] == pytest.approx(0.5 / 1.2)
    mean = 0.7 / 3
    assert got["imbalance_measured"] == pytest.approx((0.4 - mean) / mean)
    assert measured_balance([0.3, 0.3]) == {"busy_ms_max": pytest.approx(300.0), "wait_ratio_measured": 0.0,
                                            "imbalance_measured": 0.0}
    # one rank (or nothing measured) waits for nobody
    assert measured_balance([0.25])["wait_ratio_measured"] == 0.0
    assert measured_balance([0.0, 0.0])["wait_ratio_measured"] == 0.0
    # two ranks: (max - min) / (2 max), below 1/2 however uneven
    assert measured_balance([1.0, 3.0])["wait_ratio_measured"] == pytest.approx(1 / 3)
    assert measured_balance([1e-9, 3.0])["wait_ratio_measured"] < 0.5


def test_exposure_counts_the_same_events_in_numerator_and_denominator():
    # events [0, 4] and [3, 6]; the main thread blocked in [1, 2] and [3.5, 5]
    events, blocked = [(0.0, 4.0), (3.0, 6.0)], [(1.0, 2.0), (3.5, 5.0)]
    total, exposed = exposure(events, blocked, 0.0, 10.0)
    assert total == pytest.approx(4.0 + 3.0)
    # first event: 1 + 0.5 blocked; second: 1.5 (both count where they overlap)
    assert exposed == pytest.approx(1.5 + 1.5)
    # clipped to the step: only [2, 5] of the events and waits count
    total, exposed = exposure(events, blocked, 2.0, 5.0)
    assert total == pytest.approx(2.0 + 2.0)
    assert exposed == pytest.approx(0.5 + 1.5)
    # a wait with no event running is not communication; an event nobody waits for is hidden
    assert exposure([(0.0, 1.0)], [(2.0, 3.0)], 0.0, 5.0) == (1.0, 0.0)
    assert exposure([], [(2.0, 3.0)], 0.0, 5.0) == (0.0, 0.0)


def test_the_clock_records_tasks_from_any_thread_and_the_main_threads_waits():
    clock = CommClock()
    start = time.perf_counter()
    gate = threading.Event()
    out: list[int] = []
    th = threading.Thread(target=lambda: out.append(clock.task(lambda: gate.wait(5.0) and 7)))
    th.start()
    time.sleep(0.02)  # the main thread computes while the task runs: hidden
    clock.wait(lambda: (gate.set(), th.join()))  # then waits for it: exposed
    assert out == [7]
    assert clock.blocked_s() > 0
    clock.wait(lambda: None, event=True)  # a collective the main thread runs itself: an event, all exposed
    end = time.perf_counter()
    total, exposed = clock.measure(start, end)
    assert 0 < exposed < total <= end - start + 1e-9
    assert clock.blocked_s() == 0  # forgotten after the step
    assert clock.measure(end, time.perf_counter()) == (0.0, 0.0)


def test_an_event_still_running_at_the_end_of_a_step_counts_in_both_steps():
    clock = CommClock()
    gate, started = threading.Event(), threading.Event()
    th = threading.Thread(target=lambda: clock.task(lambda: (started.set(), gate.wait(5.0))))
    t0 = time.perf_counter()
    th.start()
    started.wait(5.0)
    time.sleep(0.01)
    t1 = time.perf_counter()
    first, _ = clock.measure(t0, t1)
    assert 0 < first <= t1 - t0
    time.sleep(0.01)
    gate.set()
    th.join()
    t2 = time.perf_counter()
    second, _ = clock.measure(t1, t2)
    assert 0 < second <= t2 - t1
    assert clock.measure(t2, time.perf_counter()) == (0.0, 0.0)


def test_an_event_the_main_thread_runs_inline_is_entirely_exposed():
    """At world size 1 lookups and sends run inline: nothing overlaps them."""
    clock = CommClock()
    clock.start()
    t0 = time.perf_counter()
    assert clock.task(lambda: time.sleep(0.01) or 3) == 3
    t1 = time.perf_counter()
    assert clock.blocked_s() > 0
    total, exposed = clock.measure(t0, t1)
    assert total > 0 and exposed == pytest.approx(total)
