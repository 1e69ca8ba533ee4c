"""Admission control: the router refuses a request early, before anything is allocated for it,
instead of queuing it where nobody sees it.

A request is admitted (:meth:`router.core.RequestRouter.start`) only while

* the router holds fewer requests than its **capacity**: its share of the cluster's capacity,
  which is the seats of the live decode (or colocated) workers, each worker's ``max_num_seqs``
  as it publishes it in the registry, plus ``max_queued_requests``, divided by the number of
  live routers (``pdcluster up --routers N``, counted from their records in Redis:
  :mod:`router.peers`; rounded up), never more than ``max_admitted_requests`` (which sizes the
  router's gRPC thread pool); otherwise it is refused with reason ``queue_full``; and
* with ``ttft_slo_ms`` set, its **predicted TTFT** at the best prefill worker is within the
  SLO: (prompt tokens already queued there + this prompt's tokens it has not cached) / that
  worker's measured prefill rate (:class:`router.load.PrefillRates`); a worker without a
  measured rate yet predicts nothing (admitted). Otherwise reason ``ttft_slo``.

A refusal is :class:`Refused`: RESOURCE_EXHAUSTED with a retry-after hint in milliseconds
(gRPC trailing metadata ``retry-after-ms``; HTTP 429 with ``Retry-After``). The hint for a full
queue is the time one seat takes to free on average (Little's law: the mean time requests spend
in the router / the seats; 1 s before anything was measured); for the SLO, how far the
prediction is over it. Each refusal counts in ``num_requests_rejected{reason}`` and logs one line
with its request id and cause, at most one a second per reason (:class:`serving.logs.ThrottledLog`:
the others of a burst are counted in one line after it).

With several routers the shares are exact only while the kernel spreads the load evenly over
them (SO_REUSEPORT hashes connections, not requests): one router may refuse while another has
room, and for a few seconds after a router dies (until its record expires) the others keep the
smaller share. The cluster as a whole never admits more than its capacity (+ N - 1 from the
rounding), instead of N times it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from router.load import LoadTracker, PrefillRates
from serving.logs import ThrottledLog
from serving.metrics import ProcessMetrics
from serving.registry import WorkerInfo
from serving.rpc import DEFAULT_MAX_QUEUED_REQUESTS

log = logging.getLogger(__name__)

QUEUE_FULL, TTFT_SLO = "queue_full", "ttft_slo"
MIN_RETRY_AFTER_MS, MAX_RETRY_AFTER_MS, DEFAULT_RETRY_AFTER_MS = 100, 60_000, 1000


@dataclass(frozen=True)
class AdmissionConfig:
    """The router's admission limits (``pdcluster up --max-queued-requests / --ttft-slo-ms``).

    Attributes:
        max_queued_requests: requests admitted beyond the decode workers' seats (>= 0).
        ttft_slo_ms: refuse a request whose predicted TTFT exceeds this (ms); ``None``: off.
        max_admitted_requests: requests admitted at most, whatever the seats; the router's
            gRPC pool has this many threads plus :data:`serving.rpc.SPARE_THREADS`.

    Raises:
        ValueError: a negative ``max_queued_requests``, a non-positive ``ttft_slo_ms`` or
            ``max_admitted_requests`` < 1.
    """

    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    ttft_slo_ms: float | None = None
    max_admitted_requests: int = 4096

    def __post_init__(self) -> None:
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.ttft_slo_ms is not None and not self.ttft_slo_ms > 0:
            raise ValueError(f"ttft_slo_ms must be positive, got {self.ttft_slo_ms}")
        if self.max_admitted_requests < 1:
            raise ValueError(f"max_admitted_requests must be >= 1, got {self.max_admitted_requests}")


@dataclass(frozen=True)
class Room:
    """What admission decides against, read once per request (:meth:`Admission.room`).

    Attributes:
        seats: the live decode (or colocated) workers' ``max_num_seqs``, summed.
        routers: live routers sharing the cluster's capacity (>= 1).
        capacity: requests this router may hold: ``ceil((seats + max_queued_requests) / routers)``,
            at most ``max_admitted_requests``.
    """

    seats: int
    routers: int
    capacity: int


class Refused(Exception):
    """A request refused by admission: ``reason`` (``queue_full`` / ``ttft_slo``), ``message``,
    ``retry_after_ms``."""

    def __init__(self, reason: str, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_ms = retry_after_ms


class Admission:
    """The admission step's figures and decisions (thread-safe).

    Args:
        cfg: the limits.
        decode_workers: ``() ->`` the live decode or colocated workers taking requests.
        prefill_workers: ``() ->`` the live prefill (or colocated) workers placement may choose.
        load: the router's per-worker load (prompt tokens queued per worker id).
        rates: measured prefill rates (per worker address).
        cached_tokens: ``(worker, prompt) ->`` prompt tokens the worker has cached.
        metrics: the router's metrics (``num_requests_rejected``).
        routers: ``() ->`` the live routers sharing the capacity (>= 1; default: this one alone).
    """

    def __init__(self, cfg: AdmissionConfig, decode_workers: Callable[[], list[WorkerInfo]],
                 prefill_workers: Callable[[], list[WorkerInfo]], load: LoadTracker, rates: PrefillRates,
                 cached_tokens: Callable[[WorkerInfo, list[int]], int], metrics: ProcessMetrics,
                 routers: Callable[[], int] = lambda: 1) -> None:
        self.cfg = cfg
        self._decode_workers = decode_workers
        self._prefill_workers = prefill_workers
        self._load = load
        self._rates = rates
        self._cached = cached_tokens
        self._metrics = metrics
        self._routers = routers
        self._lock = threading.Lock()
        self._mean_stay_s: float | None = None
        self._logs = {reason: ThrottledLog(log, f"requests refused ({reason})") for reason in (QUEUE_FULL, TTFT_SLO)}

    def seats(self) -> int:
        """Requests the live decode workers run at once (the sum of their ``max_num_seqs``)."""
        return sum(w.max_num_seqs for w in self._decode_workers())

    def room(self) -> Room:
        """The seats, live routers and this router's capacity now, read once (a refusal's message
        and hint use the figures its decision used)."""
        seats, routers = self.seats(), max(1, self._routers())
        share = math.ceil((seats + self.cfg.max_queued_requests) / routers)
        return Room(seats, routers, min(share, self.cfg.max_admitted_requests))

    def capacity(self) -> int:
        """Requests this router may hold now: its share of the seats + ``max_queued_requests``."""
        return self.room().capacity

    def queue_full(self, request_id: str, admitted: int, room: Room) -> Refused:
        """Count and log a ``queue_full`` refusal of a request that found ``admitted`` requests held
        against ``room``; returns it (the caller raises)."""
        with self._lock:
            stay = self._mean_stay_s
        seats = max(1, math.ceil(room.seats / room.routers))
        hint = DEFAULT_RETRY_AFTER_MS if stay is None else stay * 1000 / seats
        return self._refuse(QUEUE_FULL, request_id, hint,
                            f"the router is full: it holds {admitted} requests (running, queued or being admitted), "
                            f"capacity {room.capacity} (the decode "
                            f"workers' max_num_seqs + max_queued_requests {self.cfg.max_queued_requests}, "
                            f"shared by {room.routers} router(s)); retry later")

    def check_ttft(self, request_id: str, prompt: list[int]) -> None:
        """Refuse a request whose predicted TTFT exceeds ``ttft_slo_ms`` (nothing when unset).

        Raises:
            Refused: reason ``ttft_slo``.
        """
        slo = self.cfg.ttft_slo_ms
        if slo is None:
            return
        predicted = self.predicted_ttft_ms(prompt)
        if predicted is None or predicted <= slo:
            return
        raise self._refuse(TTFT_SLO, request_id, predicted - slo,
                           f"predicted time to first token {predicted:.0f} ms exceeds ttft_slo_ms {slo:g} "
                           f"(prompt tokens queued at the best prefill worker at its measured rate); retry later")

    def predicted_ttft_ms(self, prompt: list[int]) -> float | None:
        """The lowest predicted TTFT over the prefill workers with a measured rate (ms; ``None``:
        no such worker)."""
        best = None
        for w in self._prefill_workers():
            rate = self._rates.rate(w.address)
            if not rate:
                continue
            tokens = self._load.queued_tokens(w.worker_id) + max(0, len(prompt) - self._cached(w, prompt))
            ms = 1000.0 * tokens / rate
            best = ms if best is None else min(best, ms)
        return best

    def left(self, stay_s: float, alpha: float = 0.1) -> None:
        """A request left the router after ``stay_s`` seconds (the queue-full hint's mean)."""
        with self._lock:
            mean = self._mean_stay_s
            self._mean_stay_s = stay_s if mean is None else alpha * stay_s + (1 - alpha) * mean

    def _refuse(self, reason: str, request_id: str, hint_ms: float, message: str) -> Refused:
        hint = int(min(MAX_RETRY_AFTER_MS, max(MIN_RETRY_AFTER_MS, math.ceil(hint_ms))))
        self._metrics.inc("num_requests_rejected", reason=reason)
        self._logs[reason].info(request_id, "request %s refused (%s, retry after %d ms): %s", request_id or "-", reason,
                                hint, message)
        return Refused(reason, message, hint)
