"""The router's cached, periodically refreshed view of the live workers.

:class:`RegistryView` reads :meth:`~serving.registry.WorkerRegistry.live_workers`
in a background thread, keeps the last good view while Redis is unreachable, and
lets the router exclude a worker it could not reach until that worker beats again.
"""

from __future__ import annotations

import logging
import threading
import time

from serving.registry import WorkerInfo, WorkerLoadSnapshot, WorkerRegistry

log = logging.getLogger(__name__)


class RegistryView:
    """The router's cached view of live workers.

    A daemon thread refreshes :meth:`WorkerRegistry.live_workers` every
    ``period_s`` seconds. While Redis is unreachable the last good view is
    kept (already-registered workers stay routable); the first failure of an
    outage is logged as a warning.

    When Redis answers again after an outage, its liveness keys may have expired during the
    outage (a restarted Redis comes back from its append-only file without them) until each
    worker's next heartbeat re-registers it: for ``recovery_grace_s`` seconds after the
    outage a worker of the last good view that the fresh one lacks is kept, so the router
    does not see an empty cluster for a moment.

    :meth:`mark_unreachable` excludes a worker at once, until it reports a
    heartbeat whose ``updated_at`` is newer than the moment of marking
    (``time.time()`` here; worker and router clocks are assumed in sync).

    Args:
        registry: where to read.
        period_s: seconds between refreshes.
        recovery_grace_s: seconds after an outage during which workers of the last good view
            stay in it until they beat again (at least a heartbeat period).

    Raises:
        ValueError: non-positive ``period_s`` or negative ``recovery_grace_s``.
    """

    def __init__(self, registry: WorkerRegistry, period_s: float = 0.5, recovery_grace_s: float = 3.0) -> None:
        if period_s <= 0 or recovery_grace_s < 0:
            raise ValueError(f"period_s must be positive and recovery_grace_s >= 0, got {period_s}, "
                             f"{recovery_grace_s}")
        self.registry = registry
        self.period_s = period_s
        self.recovery_grace_s = recovery_grace_s
        self._recovered_at = float("-inf")
        self._lock = threading.Lock()
        self._view: list[tuple[WorkerInfo, WorkerLoadSnapshot]] = []
        self._marked: dict[str, float] = {}
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "RegistryView":
        """Refresh once synchronously (a failure is logged, not raised), then
        start the background thread.

        Returns:
            ``self``.

        Raises:
            RuntimeError: already started.
        """
        if self._thread is not None:
            raise RuntimeError("RegistryView already started")
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="registry-view", daemon=True)
        self._thread.start()
        return self

    def refresh(self) -> bool:
        """Read the live workers now; never raises.

        Returns:
            ``True`` if Redis answered (the view was replaced), ``False`` if the
            previous view was kept.
        """
        try:
            fresh = self.registry.live_workers()
        except Exception as e:
            if not self._failing:
                log.warning("registry refresh failed (%s: %s); keeping last view of %d workers",
                            type(e).__name__, e, len(self._view))
            self._failing = True
            return False
        if self._failing:
            log.info("registry refresh restored (%d workers)", len(fresh))
            self._recovered_at = time.monotonic()
        self._failing = False
        with self._lock:
            if time.monotonic() - self._recovered_at < self.recovery_grace_s:
                seen = {info.worker_id for info, _ in fresh}
                fresh = fresh + [(info, load) for info, load in self._view if info.worker_id not in seen]
            self._view = fresh
            present = {info.worker_id: load for info, load in fresh}
            for wid, marked_at in list(self._marked.items()):
                load = present.get(wid)
                # Absent: its liveness key expired, so any later entry is a new
                # heartbeat. Newer: it beat after being marked.
                if load is None or load.updated_at > marked_at:
                    del self._marked[wid]
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.refresh()

    def workers(self, role: str | None = None) -> list[tuple[WorkerInfo, WorkerLoadSnapshot]]:
        """Live workers (of ``role`` if given) from the last good view, minus
        those marked unreachable and not heard from since."""
        with self._lock:
            return [
                (info, load)
                for info, load in self._view
                if (role is None or info.role == role)
                and not (info.worker_id in self._marked and load.updated_at <= self._marked[info.worker_id])
            ]

    def addresses(self) -> set[str]:
        """The addresses of every worker in the last good view, those marked unreachable included
        (still registered: their liveness key has not expired)."""
        with self._lock:
            return {info.address for info, _ in self._view}

    def workers_now(self, role: str) -> list[tuple[WorkerInfo, WorkerLoadSnapshot]]:
        """:meth:`workers` of ``role``; when the cached view has none, Redis is read once
        first, so a worker that registered since the last periodic refresh (e.g. the
        first request right after start-up) is found instead of reported missing."""
        found = self.workers(role)
        if not found and self.refresh():
            found = self.workers(role)
        return found

    def mark_unreachable(self, worker_id: str) -> None:
        """Exclude ``worker_id`` now, until a heartbeat newer than this call."""
        with self._lock:
            self._marked[worker_id] = time.time()

    @property
    def stale(self) -> bool:
        """Whether the last refresh failed (the view may be out of date)."""
        return self._failing

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the refresh thread, joining it for up to ``timeout_s`` seconds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
