"""Keeping one worker registered and live in the Redis worker registry.

A :class:`Heartbeater` runs in every worker process: it registers the worker's
:class:`~serving.registry.WorkerInfo` and refreshes its liveness key with a
:class:`~serving.registry.WorkerLoadSnapshot` every period, riding out Redis
outages and restarts.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Callable

import redis

from serving.registry import WorkerInfo, WorkerLoadSnapshot, WorkerRegistry

log = logging.getLogger(__name__)


class Heartbeater:
    """Keeps one worker registered and live: a daemon thread that calls
    :meth:`WorkerRegistry.heartbeat` every ``period_s`` seconds.

    Redis outages do not stop it: the first failure of an outage is logged as a
    warning, it retries every period, and once Redis answers again it
    re-registers ``info`` (a restarted Redis has lost it) and logs the recovery.

    Args:
        registry: where to register.
        info: this worker's description (re-sent on re-registration).
        load_fn: returns the current load; called once per period. A snapshot
            with ``updated_at`` unset (0) is stamped with the current time.
        period_s: seconds between heartbeats.
        ttl_s: liveness TTL in seconds; default ``3 * period_s``.

    Raises:
        ValueError: non-positive ``period_s`` or ``ttl_s``.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        info: WorkerInfo,
        load_fn: Callable[[], WorkerLoadSnapshot],
        period_s: float = 1.0,
        ttl_s: float | None = None,
    ) -> None:
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        ttl_s = 3.0 * period_s if ttl_s is None else ttl_s
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.registry = registry
        self.info = info
        self.load_fn = load_fn
        self.period_s = period_s
        self.ttl_s = ttl_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    @property
    def healthy(self) -> bool:
        """Whether the last heartbeat reached Redis."""
        return not self._failing

    def start(self) -> "Heartbeater":
        """Register and send the first heartbeat synchronously, then start the
        background thread.

        Returns:
            ``self``.

        Raises:
            RuntimeError: already started.
            redis.exceptions.RedisError: Redis unreachable at start (fail fast
                on a wrong URL); the thread is not started then.
        """
        if self._thread is not None:
            raise RuntimeError("Heartbeater already started")
        load = self._current_load()
        self.registry.register(self.info, self.ttl_s)
        self.registry.heartbeat(self.info.worker_id, load, self.ttl_s)
        self._thread = threading.Thread(
            target=self._run, name=f"heartbeat-{self.info.worker_id}", daemon=True
        )
        self._thread.start()
        return self

    def _current_load(self) -> WorkerLoadSnapshot:
        load = self.load_fn()
        return load if load.updated_at > 0 else replace(load, updated_at=time.time())

    def beat(self) -> bool:
        """Send one heartbeat now (re-registering if needed); never raises.

        Returns:
            ``True`` if it reached Redis.
        """
        try:
            load = self._current_load()
            if self._failing or not self.registry.heartbeat(self.info.worker_id, load, self.ttl_s):
                self.registry.register(self.info, self.ttl_s)
                self.registry.heartbeat(self.info.worker_id, load, self.ttl_s)
        except Exception as e:  # Redis down, or load_fn failed: retry next period
            if not self._failing:
                log.warning("heartbeat of %s failed (%s: %s); retrying every %.2f s",
                            self.info.worker_id, type(e).__name__, e, self.period_s)
            self._failing = True
            return False
        if self._failing:
            log.info("heartbeat of %s restored; re-registered", self.info.worker_id)
        self._failing = False
        return True

    def _run(self) -> None:
        # fixed rate: the time a beat takes does not push the next one later
        next_at = time.monotonic() + self.period_s
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            self.beat()
            next_at = max(next_at + self.period_s, time.monotonic())

    def stop(self, deregister: bool = True, timeout_s: float = 5.0) -> None:
        """Stop the thread (joining it for up to ``timeout_s`` seconds) and,
        if ``deregister``, remove the worker from the registry (best effort:
        a Redis error is logged, not raised).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if deregister:
            try:
                self.registry.deregister(self.info.worker_id)
            except redis.exceptions.RedisError as e:
                log.warning("could not deregister %s: %s", self.info.worker_id, e)
