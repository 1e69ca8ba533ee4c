"""A worker's Prometheus metrics (declared in :mod:`serving.metrics`) and the HTTP endpoint serving them.

Where each figure comes from:

* per step (scheduler loop, :class:`engine.step_stats.StepStats`): ``prefill_step_seconds``,
  ``prefill_batch_tokens``, ``decode_time_seconds``, ``decode_batch_size``;
* per request, from the servers: prefill time, queue time, prefix-cache queries and hits,
  KV bytes and seconds sent (prefill); reservation wait, KV bytes received (decode);
  transfer failures by reason;
* read at scrape time from the scheduler's ``load()``: requests running / waiting, KV-cache
  usage; cumulative counters (preemptions, KV recomputes) follow ``load()``'s totals.

The endpoint (:mod:`serving.metrics_http`) is on the worker's host, any free port;
its address is registered in Redis (``WorkerInfo.metrics_address``) for service discovery.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.step_stats import StepStats
from serving.metrics import ProcessMetrics
from serving.metrics_http import MetricsHttpServer
from serving.worker_config import WorkerConfig

_TOTALS = ("num_preemptions", "num_kv_recomputes")  # load() keys that are also counter names


class WorkerMetrics:
    """Metrics of one worker process.

    Args:
        cfg: the worker's config (role, id, model name).
        load: ``() -> dict`` with ``num_running``, ``num_waiting``, ``num_free_blocks``,
            ``num_total_blocks`` (and for decode workers the cumulative ``num_preemptions`` /
            ``num_kv_recomputes``): the scheduler's ``load()``.
    """

    def __init__(self, cfg: WorkerConfig, load: Callable[[], dict]) -> None:
        self.m = ProcessMetrics(cfg.role, cfg.worker_id, cfg.model)
        self._load = load
        self._lock = threading.Lock()
        self._totals_seen: dict[str, int] = {}
        self._http = None
        self.m.get("num_requests_running").set_function(lambda: self._load()["num_running"])
        self.m.get("num_requests_waiting").set_function(lambda: self._load()["num_waiting"])
        self.m.get("kv_cache_usage_perc").set_function(self._usage)

    def _usage(self) -> float:
        load = self._load()
        total = load["num_total_blocks"]
        return (total - load["num_free_blocks"]) / total if total else 0.0

    def on_step(self, stats: StepStats) -> None:
        """A scheduler executed a step (called on its loop thread)."""
        if stats.kind == "prefill":
            self.m.observe("prefill_step_seconds", stats.seconds)
            self.m.observe("prefill_batch_tokens", stats.num_tokens)
        else:
            self.m.observe("decode_time_seconds", stats.seconds)
            self.m.observe("decode_batch_size", stats.num_seqs)
            self.sync_totals()

    def sync_totals(self) -> None:
        """Advance the cumulative counters to the scheduler's totals."""
        load = self._load()
        with self._lock:
            for key in _TOTALS:
                if key in load and key in self.m:
                    delta = load[key] - self._totals_seen.get(key, 0)
                    if delta > 0:
                        self.m.inc(key, delta)
                        self._totals_seen[key] = load[key]

    def prefill_computed(self, prompt_tokens: int, cached_tokens: int, queue_s: float, prefill_s: float) -> None:
        """A request's prefill ended (tokens, seconds), whatever becomes of its KV transfer."""
        m = self.m
        m.observe("prefill_time_seconds", prefill_s)
        m.observe("request_queue_time_seconds", queue_s)
        m.inc("prefix_cache_queries", prompt_tokens)
        m.inc("prefix_cache_hits", cached_tokens)

    def kv_sent(self, *, kv_bytes: int, transfer_s: float) -> None:
        """A request's KV reached the decode worker (bytes: whole blocks; seconds)."""
        self.m.inc("kv_transfer_bytes", kv_bytes)
        self.m.observe("kv_transfer_seconds", transfer_s)

    def kv_failed(self, reason: str) -> None:
        """A KV transfer failed; ``reason`` is a short class (``checksum``, ``timeout``, ...)."""
        self.m.inc("kv_transfer_failures", reason=reason)

    def reserved(self, wait_s: float) -> None:
        """A decode reservation was granted after ``wait_s`` seconds of waiting for blocks."""
        self.m.observe("kv_reservation_wait_seconds", wait_s)

    def rejected(self, reason: str) -> None:
        """A request was refused before anything was allocated (``reason``: ``queue_full``)."""
        self.m.inc("num_requests_rejected", reason=reason)

    def kv_received(self, nbytes: int) -> None:
        """``nbytes`` KV payload bytes were written into this decode worker's blocks."""
        self.m.inc("kv_received_bytes", nbytes)

    def serve(self, host: str) -> str:
        """Start the ``/metrics`` HTTP endpoint on ``host`` (any free port; open, plain HTTP:
        :class:`serving.metrics_http.MetricsHttpServer`); returns ``host:port``."""
        self._http = MetricsHttpServer(self.m.registry, host)
        return self._http.start()

    def stop(self) -> None:
        if self._http is not None:
            self._http.stop()
            self._http = None
