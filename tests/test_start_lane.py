"""The start lane (:mod:`router.start_lane`): admitted requests start one at a time, once the
burst they arrived in has passed, and never later than ``max_defer_s`` after their arrival."""

from __future__ import annotations

import threading
import time

import pytest

from router.start_lane import StartLane


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
