"""The router's own per-worker load: requests in flight and prompt tokens queued for prefill,
and each prefill worker's measured prefill rate.

Fresher than the workers' heartbeats, since it counts a request the moment it is
placed. :meth:`LoadTracker.begin` counts a placed request; the returned
:class:`RequestLoad` takes it back: its prompt tokens when the prefill call ends,
the rest when the request ends. Every policy reads the same counts.

:class:`PrefillRates` measures what a prefill worker gets through: prompt tokens computed
(uncached) per second of wall time during which the router had ``Prefill`` calls open there
(so batched calls are not counted as slower each), both decayed over busy time so recent
work weighs most. The admission step predicts a request's TTFT from it (:mod:`router.admission`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable


class LoadTracker:
    """Per-worker counts of in-flight requests and queued prompt tokens (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()

    def in_flight(self, worker_id: str) -> int:
        """Requests placed on ``worker_id`` (once per role it serves them in) and not ended."""
        with self._lock:
            return self._requests[worker_id]

    def queued_tokens(self, worker_id: str) -> int:
        """Prompt tokens sent to ``worker_id`` for prefill whose prefill call has not ended."""
        with self._lock:
            return self._tokens[worker_id]

    def begin(self, prefill_id: str, decode_id: str, prompt_tokens: int) -> "RequestLoad":
        """Count one request: in flight on both workers (twice on a colocated one, which
        serves both roles), ``prompt_tokens`` queued on the prefill worker."""
        with self._lock:
            self._requests[prefill_id] += 1
            self._requests[decode_id] += 1
            self._tokens[prefill_id] += prompt_tokens
        return RequestLoad(self, prefill_id, decode_id, prompt_tokens)

    def _take_back(self, worker_id: str, requests: int = 0, tokens: int = 0) -> None:
        with self._lock:
            for counter, n in ((self._requests, requests), (self._tokens, tokens)):
                if n:
                    counter[worker_id] -= n
                    if counter[worker_id] <= 0:
                        del counter[worker_id]


class RequestLoad:
    """One request's share of a :class:`LoadTracker`; each part is taken back once (thread-safe)."""

    def __init__(self, tracker: LoadTracker, prefill_id: str, decode_id: str, prompt_tokens: int) -> None:
        self._tracker = tracker
        self._prefill_id = prefill_id
        self._decode_id = decode_id
        self._lock = threading.Lock()
        self._tokens = prompt_tokens
        self._ended = False

    def prefill_finished(self, *_) -> None:
        """The prefill call ended (also a gRPC done-callback): its prompt tokens leave the queue."""
        with self._lock:
            tokens, self._tokens = self._tokens, 0
        if tokens:
            self._tracker._take_back(self._prefill_id, tokens=tokens)

    def end(self) -> None:
        """The request ended: everything it still counts is taken back."""
        self.prefill_finished()
        with self._lock:
            ended, self._ended = self._ended, True
        if not ended:
            self._tracker._take_back(self._prefill_id, requests=1)
            self._tracker._take_back(self._decode_id, requests=1)


class _Busy:
    __slots__ = ("in_flight", "last_s", "busy", "tokens")

    def __init__(self, now: float) -> None:
        self.in_flight, self.last_s, self.busy, self.tokens = 0, now, 0.0, 0.0


class PrefillRates:
    """Measured prefill rate (tokens/s) per prefill worker address (thread-safe).

    The rate is (prompt tokens computed) / (busy seconds), both summed with an exponential
    decay over busy time (time constant ``horizon_s``), so recent work weighs most and idle
    time never counts. A call's tokens count when it ends, undecayed, so calls that last a
    good part of ``horizon_s`` read slightly fast (about 5% for 1 s calls and 10 s).

    Args:
        horizon_s: the decay's time constant, in busy seconds.
        clock: monotonic seconds (a fake one in tests).

    Raises:
        ValueError: a non-positive ``horizon_s``.
    """

    def __init__(self, horizon_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be positive, got {horizon_s}")
        self.horizon_s, self._clock = horizon_s, clock
        self._lock = threading.Lock()
        self._workers: dict[str, _Busy] = {}

    def started(self, address: str) -> None:
        """A ``Prefill`` call to ``address`` was sent."""
        with self._lock:
            self._advance(address).in_flight += 1

    def finished(self, address: str, tokens: int) -> None:
        """A ``Prefill`` call to ``address`` ended, having computed ``tokens`` prompt tokens
        (0 for a failed or cancelled call)."""
        with self._lock:
            w = self._advance(address)
            w.in_flight = max(0, w.in_flight - 1)
            w.tokens += tokens

    def rate(self, address: str) -> float | None:
        """The measured rate of ``address`` in prompt tokens per second (``None``: no tokens
        measured yet)."""
        with self._lock:
            w = self._workers.get(address)
            return w.tokens / w.busy if w is not None and w.tokens > 0 and w.busy > 0 else None

    def _advance(self, address: str) -> _Busy:
        now = self._clock()
        w = self._workers.get(address)
        if w is None:
            w = self._workers[address] = _Busy(now)
        if w.in_flight and now > w.last_s:
            decay = math.exp(-(now - w.last_s) / self.horizon_s)
            w.tokens *= decay
            w.busy = w.busy * decay + self.horizon_s * (1.0 - decay)  # the decayed integral of busy time
        w.last_s = now
        return w
