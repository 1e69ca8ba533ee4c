"""``pdcluster top``: a live terminal view of a running cluster, from its Prometheus endpoints.

Every second it asks the router's HTTP server for the scrape targets
(``/v1/prometheus/targets``, Prometheus' HTTP service-discovery format), scrapes each
target's ``/metrics`` (parsed by prometheus-client's own parser) and shows, per process:
requests running / waiting, KV-cache usage, and over the last interval the mean prefill
time and decode step time (from histogram ``_sum`` / ``_count`` deltas), their ratio, token
and KV-transfer rates, prefix-cache hit rate and preemptions; for the router, TTFT, ITL
and E2E means and the request rate.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

PREFIX = "pdcluster:"


@dataclass
class Scrape:
    """One target's samples: ``{(name, frozenset(extra labels)): value}`` and when."""

    role: str
    worker_id: str
    at: float
    values: dict[tuple[str, frozenset], float] = field(default_factory=dict)

    def total(self, name: str) -> float:
        """Sum of ``name`` over every label set (``0.0`` when absent)."""
        return sum(v for (n, _), v in self.values.items() if n == name)


def fetch_targets(base_url: str, timeout_s: float = 2.0) -> list[dict]:
    """The router's Prometheus HTTP-SD document: ``[{"targets": [...], "labels": {...}}]``.

    Raises:
        OSError: the router's HTTP server is unreachable.
    """
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/v1/prometheus/targets", timeout=timeout_s) as r:
        return json.loads(r.read())


def scrape(target: str, labels: dict, timeout_s: float = 2.0) -> Scrape:
    """Scrape ``http://{target}/metrics``.

    Raises:
        OSError: the target is unreachable.
    """
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    out = Scrape(labels.get("role", "?"), labels.get("worker_id", target), time.monotonic())
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(PREFIX):
                extra = frozenset((k, v) for k, v in s.labels.items()
                                  if k not in ("role", "worker_id", "model_name", "le"))
                if "le" not in s.labels:
                    out.values[(s.name[len(PREFIX):], extra)] = s.value
    return out


def _mean_ms(now: Scrape, before: Scrape | None, name: str) -> float | None:
    """Mean of histogram ``name`` over the interval, in milliseconds (``None``: no observation)."""
    if before is None:
        return None
    n = now.total(f"{name}_count") - before.total(f"{name}_count")
    return (now.total(f"{name}_sum") - before.total(f"{name}_sum")) / n * 1e3 if n > 0 else None


def _rate(now: Scrape, before: Scrape | None, name: str) -> float | None:
    if before is None or now.at <= before.at:
        return None
    return (now.total(name) - before.total(name)) / (now.at - before.at)


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def cluster_ratio(scrapes: list[Scrape], previous: dict[str, Scrape]) -> float | None:
    """Prefill compute seconds per decode-step second over the interval, all workers together
    (the ``pdcluster:prefill_decode_time_ratio:rate1m`` rule's figure)."""
    def spent(name: str) -> float:
        return sum(s.total(name) - previous[s.worker_id].total(name) for s in scrapes if s.worker_id in previous)
    decode = spent("decode_time_seconds_sum")
    return spent("prefill_time_seconds_sum") / decode if decode > 0 else None


def render(scrapes: list[Scrape], previous: dict[str, Scrape]) -> Group:
    """The tables for one refresh (``previous``: the last scrape of each worker id)."""
    workers = Table(title="workers", expand=True)
    for col in ("worker", "role", "run", "wait", "KV used", "prefill ms", "decode step ms", "P/D",
                "tok/s", "KV MB/s", "prefix hit", "preempt"):
        workers.add_column(col, justify="right" if col not in ("worker", "role") else "left")
    router = Table(title="router", expand=True)
    for col in ("run", "wait", "req/s", "TTFT ms", "ITL ms", "E2E ms", "errors", "cluster P/D"):
        router.add_column(col, justify="right")
    ratio = cluster_ratio(scrapes, previous)
    for s in sorted(scrapes, key=lambda s: (s.role, s.worker_id)):
        b = previous.get(s.worker_id)
        if s.role == "router":
            router.add_row(_fmt(s.total("num_requests_running"), ".0f"), _fmt(s.total("num_requests_waiting"), ".0f"),
                           _fmt(_rate(s, b, "e2e_request_latency_seconds_count"), ".2f"),
                           _fmt(_mean_ms(s, b, "time_to_first_token_seconds")),
                           _fmt(_mean_ms(s, b, "inter_token_latency_seconds")),
                           _fmt(_mean_ms(s, b, "e2e_request_latency_seconds")),
                           _fmt(s.total("request_errors_total"), ".0f"), _fmt(ratio, ".2f"))
            continue
        prefill, decode = _mean_ms(s, b, "prefill_time_seconds"), _mean_ms(s, b, "decode_time_seconds")
        queries = _rate(s, b, "prefix_cache_queries_total")
        hits = _rate(s, b, "prefix_cache_hits_total")
        kv_rate = _rate(s, b, "kv_transfer_bytes_total") or _rate(s, b, "kv_received_bytes_total")
        tok = _rate(s, b, "prefill_batch_tokens_sum") or (
            _rate(s, b, "decode_batch_size_sum") if "decode" in s.role or s.role == "colocated" else None)
        workers.add_row(s.worker_id, s.role, _fmt(s.total("num_requests_running"), ".0f"),
                        _fmt(s.total("num_requests_waiting"), ".0f"), _fmt(100 * s.total("kv_cache_usage_perc"), ".1f") + "%",
                        _fmt(prefill), _fmt(decode), _fmt(prefill / decode if prefill and decode else None, ".2f"),
                        _fmt(tok), _fmt(kv_rate / 1e6 if kv_rate is not None else None, ".2f"),
                        _fmt(100 * hits / queries if queries else None, ".0f") + ("%" if queries else ""),
                        _fmt(s.total("num_preemptions_total"), ".0f"))
    return Group(router, workers)


def snapshot(base_url: str) -> list[Scrape]:
    """Scrape every target the router lists (unreachable targets are skipped)."""
    out = []
    for group in fetch_targets(base_url):
        for target in group.get("targets", []):
            try:
                out.append(scrape(target, group.get("labels", {})))
            except OSError:
                continue
    return out


def run_top(base_url: str, interval_s: float = 1.0, iterations: int | None = None,
            console: Console | None = None) -> int:
    """Refresh the view every ``interval_s`` seconds until interrupted (or ``iterations`` times).

    Returns:
        0, or 1 when the router's HTTP server cannot be reached (message on stderr).
    """
    console = console or Console()
    previous: dict[str, Scrape] = {}
    try:
        scrapes = snapshot(base_url)
    except OSError as e:
        print(f"error: cannot reach the router's HTTP server at {base_url}: {e}", file=sys.stderr)
        return 1
    with Live(render(scrapes, previous), console=console, refresh_per_second=4, transient=False) as live:
        done = 0
        try:
            while iterations is None or done < iterations:
                time.sleep(interval_s)
                previous = {s.worker_id: s for s in scrapes}
                try:
                    scrapes = snapshot(base_url)
                except OSError:
                    continue
                live.update(render(scrapes, previous))
                done += 1
        except KeyboardInterrupt:
            pass
    return 0
