"""``pdcluster top``: a live terminal view of a running cluster, from its Prometheus endpoints.

Every second it asks the router's HTTP server for the scrape targets
(``/v1/prometheus/targets``, Prometheus' HTTP service-discovery format), scrapes each
target's ``/metrics`` (parsed by prometheus-client's own parser) and shows, per process:
requests running / waiting, KV-cache usage, and over the last interval the mean prefill
time and decode step time (from histogram ``_sum`` / ``_count`` deltas), prefill-step seconds
per decode-step second (P/D), token and KV-transfer rates, prefix-cache hit rate and
preemptions; for the router, TTFT, ITL and E2E means, the request rate and the errors so far: those
the cluster failed apart from those refused or left (:data:`CLIENT_CODES`: bad requests, client gone).
With an API key, every request carries ``Authorization: Bearer KEY`` (the router's discovery
endpoint and ``/metrics`` need it;
the workers' ``/metrics`` ignore it, as they do Prometheus' header). With a CA (``tls_ca``)
the router is reached over HTTPS and its certificate verified; the workers' ``/metrics``
stay plain HTTP.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from common.grpc_metadata import AUTHORIZATION, bearer
from pdcluster.client import API_KEY_ENV, read_ca

PREFIX = "pdcluster:"
CLIENT_CODES = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "OUT_OF_RANGE", "ALREADY_EXISTS", "FAILED_PRECONDITION",
                          "UNAUTHENTICATED", "PERMISSION_DENIED", "CANCELLED", "RESOURCE_EXHAUSTED",
                          "DEADLINE_EXCEEDED"})
"""Status codes of ``request_errors_total`` that say the request was refused or left, not that the cluster
failed it: a bad request (HTTP 4xx), a missing or wrong API key, a client gone, an overload refusal (429),
the client's own deadline or a body sent too slowly (408)."""


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

    def errors(self) -> tuple[float, float]:
        """``request_errors_total`` split: ``(failed by the cluster, refused or left: CLIENT_CODES)``."""
        failed = left = 0.0
        for (n, labels), v in self.values.items():
            if n == "request_errors_total":
                if dict(labels).get("code") in CLIENT_CODES:
                    left += v
                else:
                    failed += v
        return failed, left


def _get(url: str, api_key: str | None, timeout_s: float, context: ssl.SSLContext | None = None) -> bytes:
    headers = {AUTHORIZATION: bearer(api_key)[1]} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s,
                                context=context) as r:
        return r.read()


def tls_context(tls_ca: str | bytes | None) -> ssl.SSLContext | None:
    """An SSL context trusting the CA ``tls_ca`` (PEM or a path; ``None``: none).

    Raises:
        OSError: the CA file cannot be read.
    """
    return None if tls_ca is None else ssl.create_default_context(cadata=read_ca(tls_ca).decode())


def fetch_targets(base_url: str, timeout_s: float = 2.0, api_key: str | None = None,
                  context: ssl.SSLContext | None = None) -> list[dict]:
    """The router's Prometheus HTTP-SD document: ``[{"targets": [...], "labels": {...}}]``.

    Raises:
        urllib.error.HTTPError: the router refused (401: the API key is missing or wrong).
        OSError: the router's HTTP server is unreachable (or its certificate not trusted).
    """
    return json.loads(_get(f"{base_url.rstrip('/')}/v1/prometheus/targets", api_key, timeout_s, context))


def scrape(target: str, labels: dict, timeout_s: float = 2.0, api_key: str | None = None,
           context: ssl.SSLContext | None = None) -> Scrape:
    """Scrape ``http://{target}/metrics`` (``https://`` with a ``context``).

    Raises:
        OSError: the target is unreachable or refused.
    """
    scheme = "http" if context is None else "https"
    text = _get(f"{scheme}://{target}/metrics", api_key, timeout_s, context).decode()
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
    """Prefill-step seconds per decode-step second over the interval, all workers together
    (the ``pdcluster:prefill_decode_time_ratio:rate1m`` rule's figure: step wall times on both
    sides, so a batched prefill step counts once, not once per request in it)."""
    def spent(name: str) -> float:
        return sum(s.total(name) - previous[s.worker_id].total(name) for s in scrapes if s.worker_id in previous)
    decode = spent("decode_time_seconds_sum")
    return spent("prefill_step_seconds_sum") / decode if decode > 0 else None


def _step_ratio(now: Scrape, before: Scrape | None) -> float | None:
    """One (colocated) worker's prefill-step seconds per decode-step second over the interval."""
    prefill, decode = _rate(now, before, "prefill_step_seconds_sum"), _rate(now, before, "decode_time_seconds_sum")
    return prefill / decode if prefill and decode else None


def _counter_sums(s: Scrape) -> dict[str, float]:
    """Each counter-like series of ``s`` (``_total``, ``_sum``, ``_count``) summed over its label sets."""
    sums: dict[str, float] = {}
    for (name, _), value in s.values.items():
        if name.endswith(("_total", "_sum", "_count")):
            sums[name] = sums.get(name, 0.0) + value
    return sums


def _restarted(now: Scrape, before: Scrape) -> bool:
    """Whether a counter of ``now`` is below ``before``'s: the process restarted in between (a worker
    replaced under the same id), so no rate over the interval can be taken."""
    now_sums = _counter_sums(now)
    return any(now_sums.get(name, 0.0) < value for name, value in _counter_sums(before).items())


WORKERS_CAPTION = ("rates and means over the refresh interval; (total): since the process started. tok/s: prompt "
                   "tokens computed (prefill), rows decoded (decode). prefill ms: per request, the steps it was in. "
                   "P/D: prefill / decode step time of a colocated worker")


def render(scrapes: list[Scrape], previous: dict[str, Scrape]) -> Group:
    """The tables for one refresh (``previous``: the last scrape of each worker id; one whose process
    restarted since gives no rates this time, as Prometheus' ``rate`` treats a counter reset)."""
    now_by_id = {s.worker_id: s for s in scrapes}
    previous = {w: b for w, b in previous.items() if w not in now_by_id or not _restarted(now_by_id[w], b)}
    workers = Table(title="workers", expand=True, caption=WORKERS_CAPTION)
    for col in ("worker", "role", "run", "wait", "KV used", "prefill ms", "decode step ms", "P/D",
                "tok/s", "KV MB/s", "prefix hit", "preempts (total)"):
        workers.add_column(col, justify="right" if col not in ("worker", "role") else "left")
    router = Table(title="router", expand=True)
    for col in ("router", "run", "wait", "req/s", "TTFT ms", "ITL ms", "E2E ms", "failed (total)",
                "refused/left (total)", "cluster P/D"):
        router.add_column(col, justify="right" if col != "router" else "left")  # one row per router (--routers N)
    ratio = cluster_ratio(scrapes, previous)
    for s in sorted(scrapes, key=lambda s: (s.role, s.worker_id)):
        b = previous.get(s.worker_id)
        if s.role == "router":
            router.add_row(s.worker_id, _fmt(s.total("num_requests_running"), ".0f"),
                           _fmt(s.total("num_requests_waiting"), ".0f"),
                           _fmt(_rate(s, b, "e2e_request_latency_seconds_count"), ".2f"),
                           _fmt(_mean_ms(s, b, "time_to_first_token_seconds")),
                           _fmt(_mean_ms(s, b, "inter_token_latency_seconds")),
                           _fmt(_mean_ms(s, b, "e2e_request_latency_seconds")),
                           *(_fmt(n, ".0f") for n in s.errors()), _fmt(ratio, ".2f"))
            continue
        prefill, decode = _mean_ms(s, b, "prefill_time_seconds"), _mean_ms(s, b, "decode_time_seconds")
        queries = _rate(s, b, "prefix_cache_queries_total")
        hits = _rate(s, b, "prefix_cache_hits_total")
        kv_rate = _rate(s, b, "kv_transfer_bytes_total") or _rate(s, b, "kv_received_bytes_total")
        tok = _rate(s, b, "prefill_batch_tokens_sum") or (
            _rate(s, b, "decode_batch_size_sum") if "decode" in s.role or s.role == "colocated" else None)
        workers.add_row(s.worker_id, s.role, _fmt(s.total("num_requests_running"), ".0f"),
                        _fmt(s.total("num_requests_waiting"), ".0f"),
                        _fmt(100 * s.total("kv_cache_usage_perc"), ".1f") + "%",
                        _fmt(prefill), _fmt(decode), _fmt(_step_ratio(s, b), ".2f"),
                        _fmt(tok), _fmt(kv_rate / 1e6 if kv_rate is not None else None, ".2f"),
                        _fmt(100 * hits / queries if queries else None, ".0f") + ("%" if queries else ""),
                        _fmt(s.total("num_preemptions_total"), ".0f"))
    for gone in sorted(set(previous) - set(now_by_id)):  # listed before, not answering now (dead or restarting)
        table = router if previous[gone].role == "router" else workers
        table.add_row(gone, *(["not answering"] if table is router else [previous[gone].role, "not answering"]))
    return Group(router, workers)


def snapshot(base_url: str, api_key: str | None = None, context: ssl.SSLContext | None = None) -> list[Scrape]:
    """Scrape every target the router lists (unreachable targets are skipped); the router's own
    over HTTPS when ``context`` is given.

    Raises:
        OSError: as :func:`fetch_targets`.
    """
    out = []
    for group in fetch_targets(base_url, api_key=api_key, context=context):
        labels = group.get("labels", {})
        for target in group.get("targets", []):
            try:
                out.append(scrape(target, labels, api_key=api_key,
                                  context=context if labels.get("role") == "router" else None))
            except (OSError, http.client.HTTPException):
                continue
    return out


GONE_SHOWN_S = 30.0
"""Seconds a target that stopped answering stays listed as "not answering" (a dead or restarting
worker; one scaled away leaves the view after this)."""
PIPED_WIDTH = 160
"""Columns of the view when stdout is no terminal and ``$COLUMNS`` is unset (the whole workers table)."""


def run_top(base_url: str, interval_s: float = 1.0, iterations: int | None = None,
            console: Console | None = None, api_key: str | None = None, tls_ca: str | bytes | None = None,
            unreachable_hint: str = "") -> int:
    """Refresh the view every ``interval_s`` seconds until interrupted (or ``iterations`` times);
    ``tls_ca``: the CA verifying the router's HTTPS certificate (:func:`tls_context`);
    ``unreachable_hint``: added to the error when the router cannot be reached at first.

    Returns:
        0, or 1 when ``tls_ca`` cannot be read, or the router's HTTP server cannot be reached or
        refuses the API key (message on stderr).
    """
    if console is None:  # piped or scripted: rich's 80 columns would clip the workers table to "wor… | dec…"
        wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
        console = Console(width=PIPED_WIDTH if wide else None)
    previous: dict[str, Scrape] = {}
    try:
        context = tls_context(tls_ca)
    except (OSError, ValueError, TypeError) as e:  # the CA file cannot be read or holds no PEM certificate
        print(f"error: --tls-ca {tls_ca}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 1
    try:
        scrapes = snapshot(base_url, api_key, context)
    except urllib.error.HTTPError as e:
        hint = f": give --api-key or ${API_KEY_ENV}" if e.code == 401 else ""
        Console(stderr=True).print(f"error: the router's HTTP server at {base_url} answered {e.code} {e.reason}{hint}")
        return 1
    except OSError as e:
        print(f"error: cannot reach the router's HTTP server at {base_url}: {e}{unreachable_hint}", file=sys.stderr)
        return 1
    except http.client.HTTPException as e:  # something answered, not in HTTP: a gRPC port, most likely
        print(f"error: {base_url} does not answer HTTP ({type(e).__name__}); is it the router's gRPC port? "
              "give its HTTP port (up's --http-port, default 8000)", file=sys.stderr)
        return 1
    with Live(render(scrapes, previous), console=console, refresh_per_second=4, transient=False) as live:
        done = 0
        try:
            while iterations is None or done < iterations:
                time.sleep(interval_s)
                current, now = {s.worker_id: s for s in scrapes}, time.monotonic()
                previous = {w: b for w, b in previous.items()  # a target gone shows "not answering" a while
                            if w not in current and now - b.at < GONE_SHOWN_S} | current
                done += 1
                try:
                    scrapes = snapshot(base_url, api_key, context)
                except (OSError, http.client.HTTPException) as e:  # the last view stays, marked stale
                    live.update(Group(Text(f"cannot reach the router's HTTP server at {base_url}: {e}; the view "
                                           "below is from the last answer", style="bold red"), render(scrapes, {})))
                    continue
                live.update(render(scrapes, previous))
        except KeyboardInterrupt:
            pass
    if not console.is_terminal:  # rich ends a terminal's last frame with a newline, a piped one without
        console.line()
    return 0
