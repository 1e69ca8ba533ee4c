"""Refusals first: admitted requests are placed one at a time, once a burst of arrivals has passed.

A router process runs its request path under one GIL, and its gRPC server hands every call from
its polling thread to a pool thread, each handoff waiting for the GIL. Refusing a request costs
the request path ~40 us; starting an admitted one (placement, opening the worker calls, their
channel's events, then the workers' prefill competing for the cores) costs around a
millisecond. Under a burst (500 requests at once against a router with room for 72) the starts,
run on as many threads as requests were admitted, keep the GIL from the threads that would hand
over and refuse the rest: the last refusal then reaches its client only after every start, 170 ms
(median of 6 bursts) after its send on a quiet 2-core machine, where a bare gRPC server refuses
the same burst in 70 ms (``bench/overload.py``).

:class:`StartLane` orders the work. Every arrival is noted (:meth:`StartLane.arrived`, refused
ones included), and so is every call the gRPC server has handed over whose handler has not
started yet (:class:`ArrivalPool`, the router's gRPC thread pool: gRPC's polling thread submits
each new call there, the moment the call reaches Python). An admitted request (validated and
tokenized on arrival, so an invalid one is refused at once) is placed inside
:meth:`StartLane.turn`, one at a time, once no handed-over call waits for its handler and
``quiet_s`` passed without an arrival and since the previous turn ended (the gap lets the server
hand over the calls that came meanwhile: a turn does not count as quiet), and at the latest
``max_defer_s`` after its own arrival. A lone request waits ``quiet_s`` (3 ms); under a
continuous stream of arrivals a placement is late by at most ``max_defer_s`` (0.5 s) and
placements then follow each other ``quiet_s`` apart.

Arrivals were first noted only when a handler ran. On a contended machine the polling thread then
hands calls over with gaps longer than ``quiet_s`` while hundreds wait behind it, and placements
started mid-burst, which slowed the hand-over further (``bench/results/overload*.md``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

DEFAULT_QUIET_S = 0.003
DEFAULT_MAX_DEFER_S = 0.5


class StartLane:
    """Serializes admitted requests' placements behind bursts of arrivals. Thread-safe.

    Args:
        quiet_s: a turn waits until no request arrived and no turn ended for this long (seconds).
        max_defer_s: a turn waits at most this long after its request arrived (seconds).

    Raises:
        ValueError: a negative ``quiet_s`` or ``max_defer_s``.
    """

    def __init__(self, quiet_s: float = DEFAULT_QUIET_S, max_defer_s: float = DEFAULT_MAX_DEFER_S) -> None:
        if quiet_s < 0 or max_defer_s < 0:
            raise ValueError(f"quiet_s ({quiet_s}) and max_defer_s ({max_defer_s}) must be >= 0")
        self.quiet_s = quiet_s
        self.max_defer_s = max_defer_s
        self._lane = threading.Lock()
        self._backlog = threading.Condition(threading.Lock())
        self._waiting = 0  # calls handed over whose handler has not started
        self._last_arrival = float("-inf")
        self._last_turn_end = float("-inf")

    def arrived(self) -> float:
        """Note a request's arrival, before admission decides on it; returns its time
        (``time.monotonic()`` seconds) for :meth:`turn` and :meth:`wait_quiet`."""
        self._last_arrival = now = time.monotonic()
        return now

    def handed_over(self) -> None:
        """A call reached the process and waits for its handler (:class:`ArrivalPool`); an arrival."""
        with self._backlog:
            self._waiting += 1
        self.arrived()

    def handler_started(self) -> None:
        """A call :meth:`handed_over` reached its handler."""
        with self._backlog:
            self._waiting -= 1
            if self._waiting == 0:
                self._backlog.notify_all()

    @property
    def waiting(self) -> int:
        """Calls handed over whose handler has not started."""
        return self._waiting

    @contextmanager
    def turn(self, arrival: float) -> Iterator[None]:
        """Hold the lane: wait for the other turns, then :meth:`wait_quiet`; the placement runs inside."""
        with self._lane:
            self.wait_quiet(arrival)
            try:
                yield
            finally:
                self._last_turn_end = time.monotonic()

    def wait_quiet(self, arrival: float) -> None:
        """Wait until no handed-over call waits for its handler and ``quiet_s`` passed since the last
        arrival and the last turn's end, or until ``max_defer_s`` after ``arrival``, whichever comes first."""
        deadline = arrival + self.max_defer_s
        with self._backlog:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    return
                if self._waiting:  # woken when the backlog empties
                    self._backlog.wait(deadline - now)
                    continue
                quiet_at = max(self._last_arrival, self._last_turn_end) + self.quiet_s
                if now >= quiet_at:
                    return
                self._backlog.wait(min(quiet_at, deadline) - now)


class ArrivalPool(futures.ThreadPoolExecutor):
    """A gRPC server's thread pool that tells ``lane`` of every call it is handed, when gRPC's
    polling thread hands it over (before a thread is free for it), and when its handler starts.

    Args:
        max_workers: threads at most.
        lane: the start lane to tell.
    """

    def __init__(self, max_workers: int, lane: StartLane) -> None:
        super().__init__(max_workers=max_workers)
        self._lane = lane

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        self._lane.handed_over()
        try:
            return super().submit(self._run, fn, *args, **kwargs)
        except BaseException:  # shut down: it never waits for a thread
            self._lane.handler_started()
            raise

    def _run(self, fn, /, *args, **kwargs):
        self._lane.handler_started()
        return fn(*args, **kwargs)
