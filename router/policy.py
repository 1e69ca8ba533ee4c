"""Worker selection policies, chosen by name (``least_loaded``, ``round_robin``).

Every policy skips draining workers (``WorkerLoadSnapshot.draining``: being
removed by ``pdcluster scale``; they finish what they have but take nothing new).
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from typing import Callable

from serving.registry import WorkerInfo, WorkerLoadSnapshot

Candidate = tuple[WorkerInfo, WorkerLoadSnapshot]


class NoWorkerError(RuntimeError):
    """No live, non-draining worker of the asked role."""


class InFlight:
    """The router's own count of requests in flight per worker (fresher than heartbeats)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n: Counter[str] = Counter()

    def acquire(self, worker_id: str) -> None:
        with self._lock:
            self._n[worker_id] += 1

    def release(self, worker_id: str) -> None:
        with self._lock:
            self._n[worker_id] -= 1
            if self._n[worker_id] <= 0:
                del self._n[worker_id]

    def get(self, worker_id: str) -> int:
        with self._lock:
            return self._n[worker_id]


Policy = Callable[[list[Candidate], InFlight], WorkerInfo]


def serving(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates that take new requests (not draining).

    Raises:
        NoWorkerError: none does (the message counts the draining ones).
    """
    usable = [c for c in candidates if not c[1].draining]
    if not usable:
        draining = len(candidates)
        raise NoWorkerError(f"no live worker ({draining} draining)" if draining else "no live worker")
    return usable


def least_loaded(candidates: list[Candidate], inflight: InFlight) -> WorkerInfo:
    """Fewest in-flight requests (router view + worker's queue), then most free KV blocks;
    draining workers are skipped.

    Raises:
        NoWorkerError: no live, non-draining candidate.
    """
    candidates = serving(candidates)
    best = min(candidates, key=lambda c: (inflight.get(c[0].worker_id) + c[1].num_waiting,
                                          -c[1].num_free_blocks, c[0].worker_id))
    return best[0]


class RoundRobin:
    """Each non-draining candidate in turn, in worker-id order."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def __call__(self, candidates: list[Candidate], inflight: InFlight) -> WorkerInfo:
        """Raises NoWorkerError: no live, non-draining candidate."""
        ordered = sorted(serving(candidates), key=lambda c: c[0].worker_id)
        return ordered[next(self._counter) % len(ordered)][0]


_POLICIES: dict[str, Callable[[], Policy]] = {
    "least_loaded": lambda: least_loaded,
    "round_robin": RoundRobin,
}


def get_policy(name: str) -> Policy:
    """Raises KeyError naming the known policies."""
    if name not in _POLICIES:
        raise KeyError(f"unknown routing policy {name!r}; known: {sorted(_POLICIES)}")
    return _POLICIES[name]()
