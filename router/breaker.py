"""Circuit breaking on the router: a worker whose internal RPCs keep failing in transport is
skipped by placement for a cool-down, then probed before it gets requests again.

Per worker (keyed by its gRPC address, what the router's channels know):

* **closed** (normal): every finished internal call is classified (:func:`classify`): a
  transport failure (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL or UNKNOWN with no status from a
  pdcluster handler: connection refused or lost, an unanswered keepalive ping, a router-set
  deadline) counts, and so does INTERNAL from the worker's own handler (its model step failed:
  a worker whose steps keep failing answers fast and would otherwise draw the most requests
  under ``least_loaded``); a success resets the count; anything else (a status the worker's
  handler chose, e.g. INVALID_ARGUMENT or RESOURCE_EXHAUSTED, and a call the router or its
  client cancelled) is neutral. ``failures`` consecutive failures open it (one log line, one
  ``circuit_breaker_trips`` count).
* **open**: :meth:`CircuitBreaker.allows` says no, so placement skips the worker
  (:class:`router.placement.Placer`, besides the registry view's own
  :meth:`~serving.discovery.RegistryView.mark_unreachable`).
* **probing**: the first placement after ``cooldown_s`` sends one probe (a gRPC health
  ``Check`` with a short deadline); the worker stays skipped until it answers SERVING (closed
  again) or it fails (open for another cool-down). A success of any other call also closes it.

A worker that leaves the registry (dead, replaced at a new address) is forgotten (:meth:`CircuitBreaker.retain`,
called by the router on every registry view period).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from serving.metrics import ProcessMetrics

log = logging.getLogger(__name__)

TRANSPORT_FAILURES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


@dataclass(frozen=True)
class BreakerConfig:
    """The router's circuit breaker (``pdcluster up --breaker-failures / --breaker-cooldown-s``).

    Attributes:
        failures: consecutive transport failures of a worker's calls that open its breaker.
        cooldown_s: seconds an open breaker skips its worker before probing it.
        probe_timeout_s: deadline of the probe (a gRPC health ``Check``), seconds.
        ping_s: the router pings each worker connection with open calls this often (gRPC
            keepalive) and fails its calls with UNAVAILABLE when a ping is not answered within
            as long (seconds): a worker that stopped answering fails its calls instead of
            holding them forever.

    Raises:
        ValueError: ``failures`` < 1, or a non-positive duration.
    """

    failures: int = 3
    cooldown_s: float = 5.0
    probe_timeout_s: float = 1.0
    ping_s: float = 2.0

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError(f"breaker failures must be >= 1, got {self.failures}")
        for name in ("cooldown_s", "probe_timeout_s", "ping_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"breaker {name} must be positive, got {getattr(self, name)}")


class Outcome(enum.Enum):
    """What a finished internal call says about its worker."""

    SUCCESS = "success"
    FAILURE = "failure"
    NEUTRAL = "neutral"


def classify(code: grpc.StatusCode, from_handler: bool) -> Outcome:
    """The outcome of a call that ended with ``code``; ``from_handler``: the worker's handler set
    the status (:func:`serving.rpc.handler_status`), so the worker answered: only its INTERNAL
    (a failed model step, the worker's own fault) counts then."""
    if code == grpc.StatusCode.OK:
        return Outcome.SUCCESS
    if from_handler:
        return Outcome.FAILURE if code == grpc.StatusCode.INTERNAL else Outcome.NEUTRAL
    if code not in TRANSPORT_FAILURES:
        return Outcome.NEUTRAL
    return Outcome.FAILURE


class _Worker:
    __slots__ = ("failures", "opened_at", "probing")

    def __init__(self) -> None:
        self.failures = 0
        self.opened_at: float | None = None
        self.probing = False


Probe = Callable[[str], "Future[bool]"]
"""``address -> `` a future that resolves True when the worker answers healthy in time."""


class CircuitBreaker:
    """Per-worker circuit breakers (thread-safe).

    Args:
        cfg: thresholds and durations.
        probe: starts a probe of a worker address (see :data:`Probe`); never blocks.
        metrics: the router's metrics (``circuit_breaker_trips``, ``circuit_breaker_open_workers``).
        clock: monotonic seconds (a fake one in tests).
    """

    def __init__(self, cfg: BreakerConfig, probe: Probe, metrics: ProcessMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._probe = probe
        self._metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self._ids: dict[str, str] = {}  # address -> worker id, as placement last saw it (for logs)

    def record(self, address: str, outcome: Outcome, detail: str = "") -> None:
        """A call to ``address`` finished with ``outcome`` (``detail``: its status, for the log)."""
        if outcome is Outcome.NEUTRAL:
            return
        with self._lock:
            w = self._workers.get(address)
            worker_id = self._ids.get(address, address)
            if outcome is Outcome.SUCCESS:
                if w is None:
                    return
                if w.opened_at is not None:
                    log.info("circuit breaker closed for worker %s at %s: a call succeeded", worker_id, address)
                w.failures, w.opened_at, w.probing = 0, None, False
                self._publish()
                return
            w = self._workers.setdefault(address, _Worker())
            w.failures += 1
            if w.opened_at is not None or w.failures < self.cfg.failures:
                return
            w.opened_at = self._clock()
            self._publish()
        log.warning("circuit breaker opened for worker %s at %s after %d consecutive failures (last: %s); "
                    "skipped for %.1fs, then probed", worker_id, address, self.cfg.failures, detail or "?",
                    self.cfg.cooldown_s)
        if self._metrics is not None:
            self._metrics.inc("circuit_breaker_trips", target_worker=worker_id)

    def allows(self, address: str, worker_id: str = "") -> bool:
        """Whether placement may choose the worker at ``address`` now. An open breaker past its
        cool-down starts one probe here (the worker stays skipped until it succeeds)."""
        with self._lock:
            if worker_id:
                self._ids[address] = worker_id
            w = self._workers.get(address)
            if w is None or w.opened_at is None:
                return True
            if w.probing or self._clock() - w.opened_at < self.cfg.cooldown_s:
                return False
            w.probing = True
        try:
            self._probe(address).add_done_callback(lambda f: self._probed(address, f))
        except Exception as e:  # noqa: BLE001 - a probe that cannot start counts as failed
            self._probed(address, _failed_future(e))
        return False

    def _probed(self, address: str, fut: Future) -> None:
        ok = not fut.cancelled() and fut.exception() is None and bool(fut.result())
        with self._lock:
            w = self._workers.get(address)
            if w is None or not w.probing:
                return  # closed meanwhile by a successful call
            w.probing = False
            if ok:
                w.failures, w.opened_at = 0, None
            else:
                w.opened_at = self._clock()
            worker_id = self._ids.get(address, address)
            self._publish()
        if ok:
            log.info("circuit breaker closed for worker %s at %s: the probe succeeded", worker_id, address)
        else:
            log.warning("circuit breaker probe of worker %s at %s failed (%s); skipped for another %.1fs", worker_id,
                        address, fut.exception() if not fut.cancelled() and fut.exception() else "not serving",
                        self.cfg.cooldown_s)

    def state(self, address: str) -> str:
        """``closed``, ``open`` or ``probing``."""
        with self._lock:
            w = self._workers.get(address)
            if w is None or w.opened_at is None:
                return "closed"
            return "probing" if w.probing else "open"

    def num_open(self) -> int:
        """Workers skipped now (open or probing)."""
        with self._lock:
            return sum(w.opened_at is not None for w in self._workers.values())

    def retain(self, addresses: set[str]) -> None:
        """Forget the workers not at ``addresses`` (the registry's live workers): a worker that died is
        replaced at a new address, and its old breaker, open for good since nothing places on the old
        address to probe it, would hold the open-workers gauge up forever."""
        with self._lock:
            gone = [a for a in self._workers if a not in addresses]
            for address in gone:
                del self._workers[address]
            for address in [a for a in self._ids if a not in addresses]:
                del self._ids[address]
            if gone:
                self._publish()

    def _publish(self) -> None:
        """Update the open-workers gauge; drop healthy entries (called holding the lock)."""
        for address in [a for a, w in self._workers.items() if w.failures == 0 and w.opened_at is None]:
            del self._workers[address]
        if self._metrics is not None:
            self._metrics.set("circuit_breaker_open_workers", sum(w.opened_at is not None
                                                                  for w in self._workers.values()))


def _failed_future(exc: BaseException) -> Future:
    fut: Future = Future()
    fut.set_exception(exc)
    return fut
