"""The router's own per-worker load: requests in flight and prompt tokens queued for prefill.

Fresher than the workers' heartbeats, since it counts a request the moment it is
placed. :meth:`LoadTracker.begin` counts a placed request; the returned
:class:`RequestLoad` takes it back: its prompt tokens when the prefill call ends,
the rest when the request ends. Every policy reads the same counts.
"""

from __future__ import annotations

import threading
from collections import Counter


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
