"""The start lane (:mod:`router.start_lane`): admitted requests start one at a time, once the
burst they arrived in has passed, and never later than ``max_defer_s`` after their arrival."""

from __future__ import annotations

import threading
import time

import pytest

from router.start_lane import ArrivalPool, StartLane


def test_settings_are_validated():
    for bad in ({"quiet_s": -1}, {"max_defer_s": -0.1}):
        with pytest.raises(ValueError, match="must be >= 0"):
            StartLane(**bad)


def test_a_lone_request_waits_quiet_s_only():
    lane = StartLane(quiet_s=0.05, max_defer_s=5)
    arrival = lane.arrived()
    with lane.turn(arrival):
        assert 0.05 <= time.monotonic() - arrival < 0.5


def test_a_start_waits_for_the_arrivals_after_it_to_pause():
    lane = StartLane(quiet_s=0.2, max_defer_s=5)
    first = lane.arrived()
    time.sleep(0.05)
    last = lane.arrived()  # another request arrived after it (refused or admitted)
    with lane.turn(first):
        assert time.monotonic() - last >= 0.2


def test_starts_are_spaced_quiet_s_apart_and_never_overlap():
    """The gap after each start lets the server hand over the calls that came during it."""
    lane = StartLane(quiet_s=0.03, max_defer_s=5)
    inside, spans = [], []

    def start():
        with lane.turn(lane.arrived()):
            inside.append(1)
            spans.append((time.monotonic(), len(inside)))
            time.sleep(0.01)
            spans.append((time.monotonic(), len(inside)))
            inside.pop()

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(n == 1 for _, n in spans)
    times = sorted(t for t, _ in spans)
    assert all(b - a >= 0.03 for a, b in zip(times[1::2], times[2::2])), times  # end of one .. start of the next


def test_under_a_continuous_stream_a_start_waits_at_most_max_defer():
    lane = StartLane(quiet_s=0.05, max_defer_s=0.3)
    stop = threading.Event()

    def stream():
        while not stop.is_set():
            lane.arrived()
            time.sleep(0.005)

    feeder = threading.Thread(target=stream)
    mine = lane.arrived()
    feeder.start()
    try:
        with lane.turn(mine):
            waited = time.monotonic() - mine
        lane.wait_quiet(mine)  # past the deadline: at once
        assert time.monotonic() - mine - waited < 0.05
    finally:
        stop.set()
        feeder.join()
    assert 0.3 <= waited < 1.0, waited


def test_a_turn_waits_for_handed_over_calls_to_reach_their_handlers():
    """A call gRPC handed over but no thread has run yet is part of the burst: placements wait for it."""
    lane = StartLane(quiet_s=0.01, max_defer_s=5)
    lane.handed_over()
    entered = threading.Event()

    def start():
        with lane.turn(time.monotonic()):
            entered.set()

    t = threading.Thread(target=start)
    t.start()
    assert not entered.wait(0.2) and lane.waiting == 1
    lane.handler_started()
    assert entered.wait(1.0)
    t.join()


def test_a_backlog_that_never_drains_defers_a_turn_at_most_max_defer():
    lane = StartLane(quiet_s=0.01, max_defer_s=0.2)
    lane.handed_over()
    mine = time.monotonic()
    with lane.turn(mine):
        assert 0.2 <= time.monotonic() - mine < 1.0


def test_the_arrival_pool_counts_each_call_until_its_handler_starts():
    lane = StartLane()
    pool = ArrivalPool(1, lane)
    release = threading.Event()
    try:
        busy = pool.submit(release.wait, 5)  # holds the pool's one thread
        queued = pool.submit(lambda a, b=0: a + b, 2, b=3)  # waits for that thread
        assert lane.waiting == 1 and time.monotonic() - lane._last_arrival < 1.0
        release.set()
        assert busy.result(5) is True and queued.result(5) == 5
        assert lane.waiting == 0
    finally:
        pool.shutdown()
    with pytest.raises(RuntimeError):  # a call a closed pool refuses never counts as waiting
        pool.submit(time.sleep, 0)
    assert lane.waiting == 0
