"""Which prefix-cache blocks each prefill worker holds, published through Redis.

A prefill worker's :class:`CacheIndexPublisher` mirrors its pool's cached block
hashes (:mod:`common.prefix_hash`) into a Redis set every period, sending only
the difference since the last publication (block events in batches), plus the
hash salt and block size needed to compute comparable hashes. The router's
:class:`CacheIndexView` reads them back periodically, so cache-aware routing
never touches Redis on the request path. Both keys expire with the worker.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Callable

import redis

log = logging.getLogger(__name__)


def _keys(cluster: str, worker_id: str) -> tuple[str, str]:
    base = f"pdcluster:{cluster}:worker:{worker_id}"
    return f"{base}:blocks", f"{base}:blocks_meta"


class CacheIndexPublisher:
    """Worker side: a daemon thread publishing ``hashes_fn()`` every ``period_s`` seconds.

    Args:
        redis_url / cluster / worker_id: where to publish.
        hashes_fn: returns the pool's cached block hashes (8-byte ``bytes``).
        model_id / block_size: the hash salt and tokens per block.
        period_s: publication period (seconds); keys expire after 3 periods.
    """

    def __init__(self, redis_url: str, cluster: str, worker_id: str, hashes_fn: Callable[[], list[bytes]],
                 model_id: str, block_size: int, period_s: float = 1.0) -> None:
        self._r = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._set_key, self._meta_key = _keys(cluster, worker_id)
        self._hashes_fn = hashes_fn
        self._meta = json.dumps({"model_id": model_id, "block_size": block_size})
        self.period_s = period_s
        self._published: set[bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cache-index")

    def start(self) -> "CacheIndexPublisher":
        self._thread.start()
        return self

    def publish(self) -> None:
        """Send the difference since the last publication (everything after a failure).

        Raises:
            redis.exceptions.RedisError: Redis unreachable.
        """
        now = set(self._hashes_fn())
        ttl_ms = int(3000 * self.period_s)
        with self._r.pipeline(transaction=True) as p:
            if self._published is None:
                p.delete(self._set_key)
                added, removed = now, set()
            else:
                added, removed = now - self._published, self._published - now
            if added:
                p.sadd(self._set_key, *added)
            if removed:
                p.srem(self._set_key, *removed)
            p.set(self._meta_key, self._meta, px=ttl_ms)
            p.pexpire(self._set_key, ttl_ms)
            p.execute()
        self._published = now

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.publish()
            except redis.exceptions.RedisError as e:
                log.warning("cache index publication failed: %s", e)
                self._published = None  # resend everything next time

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self._r.delete(self._set_key, self._meta_key)
        except redis.exceptions.RedisError:
            pass


class CacheIndexView:
    """Router side: the last known cached-block sets of prefill workers.

    Args:
        redis_url / cluster: where workers publish.
        worker_ids: returns the ids of the live prefill workers to read.
        period_s: refresh period (seconds).
    """

    def __init__(self, redis_url: str, cluster: str, worker_ids: Callable[[], list[str]],
                 period_s: float = 0.5) -> None:
        self._r = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.cluster = cluster
        self._worker_ids = worker_ids
        self.period_s = period_s
        self._lock = threading.Lock()
        self._index: dict[str, tuple[dict, set[bytes]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cache-index-view")

    def start(self) -> "CacheIndexView":
        self._thread.start()
        return self

    def refresh(self) -> None:
        """Raises redis.exceptions.RedisError when Redis is unreachable (the old view stays)."""
        fresh: dict[str, tuple[dict, set[bytes]]] = {}
        for wid in self._worker_ids():
            set_key, meta_key = _keys(self.cluster, wid)
            with self._r.pipeline(transaction=False) as p:
                p.get(meta_key)
                p.smembers(set_key)
                meta, members = p.execute()
            if meta:
                fresh[wid] = (json.loads(meta), set(members))
        with self._lock:
            self._index = fresh

    def get(self, worker_id: str) -> tuple[dict, set[bytes]] | None:
        """``(meta, hashes)`` of a worker: meta has ``model_id`` and ``block_size``."""
        with self._lock:
            return self._index.get(worker_id)

    def _run(self) -> None:
        failures = 0  # in a row: the first is logged, then the recovery (not one line a period while Redis is down)
        while not self._stop.wait(self.period_s):
            try:
                self.refresh()
            except redis.exceptions.RedisError as e:
                if not failures:
                    log.warning("cache index refresh failed: %s (retried every %.2f s; the last index is used "
                                "meanwhile)", e, self.period_s)
                failures += 1
                continue
            if failures:
                log.warning("cache index refresh works again after %d failed tries", failures)
                failures = 0

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
