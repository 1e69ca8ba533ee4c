"""The cluster's routers as each router sees them: its own record in Redis and everyone's.

``pdcluster up --routers N`` runs N router processes behind one address (they share the
public ports with SO_REUSEPORT: :mod:`router.server`). No router holds state another could
not rebuild; what they need to know of each other is small and lives in Redis: each router
refreshes its :class:`serving.registry.RouterRecord` (pid, private ``/metrics`` address)
every ``period_s`` with a TTL of ``ttl_periods`` periods, and reads the others'. A router that
dies drops out when its record expires; a stopped one removes its record at once. The
records feed Prometheus service discovery (every router's own ``/metrics``) and admission
(each router admits its share of the cluster's capacity: :mod:`router.admission`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis.exceptions import RedisError

from serving.registry import RouterRecord, WorkerRegistry

log = logging.getLogger(__name__)


class RouterPeers:
    """Publishes this router's record and keeps the last good list of live routers.

    Args:
        registry: the cluster's registry (owned: closed by :meth:`stop`).
        record: ``() ->`` this router's record (read at each refresh).
        period_s: seconds between refreshes (> 0).
        ttl_periods: a record expires after this many periods without a refresh (>= 2).

    Raises:
        ValueError: a non-positive ``period_s`` or ``ttl_periods`` < 2.
    """

    def __init__(self, registry: WorkerRegistry, record: Callable[[], RouterRecord], period_s: float,
                 ttl_periods: int = 3) -> None:
        if period_s <= 0 or ttl_periods < 2:
            raise ValueError(f"period_s must be positive and ttl_periods >= 2, got {period_s}, {ttl_periods}")
        self._reg = registry
        self._record = record
        self._period_s = period_s
        self._ttl_s = period_s * ttl_periods
        self._lock = threading.Lock()
        self._live: list[RouterRecord] = []
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="router-peers", daemon=True)

    def refresh(self) -> None:
        """Publish this router's record and read every live one (the last good list is kept,
        and one warning logged, while Redis is unreachable)."""
        mine = self._record()
        try:
            self._reg.put_router(mine, self._ttl_s)
            live = self._reg.live_routers()
        except RedisError as e:
            if not self._warned:
                log.warning("router %s cannot refresh its record in Redis: %s", mine.router_id, e)
                self._warned = True
            return
        self._warned = False
        if all(r.index != mine.index for r in live):
            live = sorted([*live, mine], key=lambda r: r.index)
        with self._lock:
            self._live = live

    def live(self) -> list[RouterRecord]:
        """The live routers (this one included), by index."""
        with self._lock:
            return list(self._live) or [self._record()]

    def count(self) -> int:
        """How many routers are live (>= 1: this one)."""
        return len(self.live())

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self.refresh()

    def start(self) -> None:
        self.refresh()
        self._thread.start()

    def stop(self) -> None:
        """Stop refreshing and remove this router's record (best effort: it expires anyway)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self._reg.remove_router(self._record().index)
        except RedisError:
            pass
        self._reg.close()
