"""Refusals first: admitted requests are placed one at a time, once a burst of arrivals has passed.

A router process runs its request path under one GIL, and its gRPC server hands every call from
its polling thread to a pool thread, each handoff waiting for the GIL. Refusing a request costs
the request path ~20 us; starting an admitted one (placement, opening the worker calls, their
channel's events) costs around a millisecond. Under a burst (500 requests at once against a
router with room for 72) the starts, run on as many threads as requests were admitted, keep the
GIL from the threads that would hand over and refuse the rest: the last refusal then reaches
its client only after every start, 170 ms (median of 6 bursts) after its send on a quiet 2-core
machine, where a bare gRPC server refuses the same burst in 70 ms (``bench/overload.py``).

:class:`StartLane` orders the work. Every arrival is noted (:meth:`StartLane.arrived`, refused
ones included). An admitted request (validated and tokenized on arrival, so an invalid one is
refused at once) is placed inside :meth:`StartLane.turn`, one at a time, once ``quiet_s``
passed without an arrival and since the previous turn ended (the gap lets the server hand over
the calls that came meanwhile: a turn does not count as quiet), and at the latest
``max_defer_s`` after its own arrival. A lone request waits ``quiet_s`` (3 ms); under a
continuous stream of arrivals a placement is late by at most ``max_defer_s`` (0.25 s) and
placements then follow each other ``quiet_s`` apart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

DEFAULT_QUIET_S = 0.003
DEFAULT_MAX_DEFER_S = 0.25


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
        self._last_arrival = float("-inf")
        self._last_turn_end = float("-inf")

    def arrived(self) -> float:
        """Note a request's arrival, before admission decides on it; returns its time
        (``time.monotonic()`` seconds) for :meth:`turn` and :meth:`wait_quiet`."""
        self._last_arrival = now = time.monotonic()
        return now

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
        """Wait until ``quiet_s`` passed since the last arrival and the last turn's end, or until
        ``max_defer_s`` after ``arrival``, whichever comes first."""
        deadline = arrival + self.max_defer_s
        while True:
            now = time.monotonic()
            quiet_at = max(self._last_arrival, self._last_turn_end) + self.quiet_s
            if now >= quiet_at or now >= deadline:
                return
            time.sleep(min(quiet_at, deadline) - now)
