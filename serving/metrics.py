"""Every Prometheus metric of pdcluster, declared once, and the per-process set built from it.

Names follow vLLM's (``vllm/v1/metrics/loggers.py``) with the ``pdcluster:`` prefix, so a
vLLM dashboard ports by replacing the prefix; counters are declared without ``_total``
(prometheus-client appends it). Every series carries ``role``, ``worker_id`` and
``model_name``; a few add one label of their own (``finished_reason``, ``code``, ``reason``,
``target_worker``: the worker a router-side series is about; ``failed_role``; ``worker_role``:
the role a router-side count of workers is about).
Units are in the names: ``_seconds``, ``_tokens``, ``_bytes``; ``kv_cache_usage_perc`` is a
fraction in [0, 1] as in vLLM.

Exposition, histogram buckets and quantile math are prometheus-client's and Prometheus'
own; nothing here formats text.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

PREFIX = "pdcluster:"
BASE_LABELS = ("role", "worker_id", "model_name")
ROUTER, PREFILL, DECODE = "router", "prefill", "decode"
WORKERS = (PREFILL, DECODE)

# Buckets (seconds / tokens). vLLM's request-latency buckets, widened at the low end
# for CPU decode steps of tens of milliseconds, and finer from 1 to 5 s, where CPU TTFTs fall (a p50
# interpolated inside one 2.5-5 s bucket read 3.7 s for TTFTs of at most 3.1 s).
_LATENCY_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
              3.0, 4.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_E2E_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
          480.0, 960.0, 1920.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_BATCH = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
_BYTES = (1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28, 1 << 30)


@dataclass(frozen=True)
class MetricSpec:
    """One metric.

    Attributes:
        name: without the prefix; counters without ``_total``.
        kind: ``"counter"``, ``"gauge"`` or ``"histogram"``.
        help: the HELP text (unit included).
        roles: the processes that export it (``router``, ``prefill``, ``decode``).
        labels: labels besides :data:`BASE_LABELS`.
        buckets: histogram upper bounds.
        preset: values of the metric's one own label whose series exist (at 0) from the start, so
            a rate over them has data before the first event (vLLM's finish reasons).

    Raises:
        ValueError: ``preset`` values for a metric without exactly one own label.
    """

    name: str
    kind: str
    help: str
    roles: tuple[str, ...]
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    preset: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.preset and len(self.labels) != 1:
            raise ValueError(f"{self.name}: preset label values need exactly one own label, got {self.labels}")


def _h(name: str, help: str, roles: tuple[str, ...], buckets: tuple[float, ...]) -> MetricSpec:
    return MetricSpec(name, "histogram", help, roles, buckets=buckets)


METRICS: tuple[MetricSpec, ...] = (
    # -- router: per request, as the client sees it ----------------------------------------
    _h("time_to_first_token_seconds", "Time to first token (seconds), from arrival at the router.", (ROUTER,),
       _LATENCY_S),
    _h("inter_token_latency_seconds", "Time between consecutive output tokens (seconds).", (ROUTER,), _LATENCY_S),
    _h("request_time_per_output_token_seconds", "Mean time per output token after the first (TPOT, seconds).",
       (ROUTER,), _LATENCY_S),
    _h("e2e_request_latency_seconds", "End-to-end request latency (seconds).", (ROUTER,), _E2E_S),
    _h("request_queue_time_seconds", "Time a request waited before its prefill began (seconds): router: arrival "
       "to the decode worker's reservation (a worker and KV blocks); prefill worker: arrival there to its first "
       "prefill step. Filter by role.", (ROUTER, PREFILL), _LATENCY_S),
    _h("request_prefill_time_seconds", "Prefill phase of finished requests (seconds): the decode worker's "
       "reservation to the first token (prefill queue, compute and KV transfer).", (ROUTER,), _LATENCY_S),
    _h("request_decode_time_seconds", "Decode phase of finished requests (seconds): first to last token.",
       (ROUTER,), _E2E_S),
    _h("request_inference_time_seconds", "Prefill and decode phases of finished requests (seconds): the "
       "reservation to the last token.", (ROUTER,), _E2E_S),
    _h("request_params_max_tokens", "max_tokens of finished requests (tokens; the default resolved).", (ROUTER,),
       _TOKENS),
    _h("request_params_n", "n of the OpenAI HTTP generation requests the router accepted (choices per prompt; a "
       "gRPC request is one choice and is not counted).", (ROUTER,), (1, 2, 5, 10, 20)),
    _h("request_prompt_tokens", "Prompt length of finished requests (tokens).", (ROUTER,), _TOKENS),
    _h("request_generation_tokens", "Generated tokens of finished requests (tokens).", (ROUTER,), _TOKENS),
    MetricSpec("prompt_tokens", "counter", "Prompt tokens of requests, prefix-cache hits included (as vLLM), counted "
               "at each request's first token; an HTTP request with n > 1 counts once per choice.", (ROUTER,)),
    MetricSpec("generation_tokens", "counter", "Generated tokens (counted as they leave the router, also those of "
               "requests that are cancelled or fail later).", (ROUTER,)),
    MetricSpec("request_success", "counter", "Finished requests by finish reason (an HTTP request with n > 1: "
               "each choice).", (ROUTER,),
               labels=("finished_reason",), preset=("stop", "length", "abort")),
    MetricSpec("request_errors", "counter", "Failed requests by status code.", (ROUTER,), labels=("code",)),
    MetricSpec("http_requests", "counter", "Requests on the router's HTTP port by method, route and answer status "
               "(router.openai.http_metrics).", (ROUTER,), labels=("method", "handler", "status")),
    MetricSpec("request_migrations", "counter",
               "Requests resumed on other workers after a worker failed them, by the failed worker's role.",
               (ROUTER,), labels=("failed_role",)),
    MetricSpec("num_requests_rejected", "counter",
               "Requests refused with RESOURCE_EXHAUSTED before anything was allocated, by reason "
               "(queue_full: the admission queue is full; ttft_slo: the predicted TTFT exceeds the SLO).",
               (ROUTER, DECODE), labels=("reason",)),
    MetricSpec("circuit_breaker_trips", "counter",
               "Times the router's circuit breaker opened for a worker (consecutive transport failures).",
               (ROUTER,), labels=("target_worker",)),
    MetricSpec("circuit_breaker_open_workers", "gauge",
               "Workers the router's circuit breaker skips now (open or being probed).", (ROUTER,)),
    MetricSpec("workers_live", "gauge", "Live workers (registered, heartbeat fresh) by role, as the router sees them.",
               (ROUTER,), labels=("worker_role",)),
    MetricSpec("workers_desired", "gauge", "Workers the cluster controller keeps, by role (absent: no controller "
               "report).", (ROUTER,), labels=("worker_role",)),
    MetricSpec("worker_restarts", "gauge", "Times a desired worker was restarted since it was placed (Ray after "
               "a crash, or the cluster controller).", (ROUTER,), labels=("target_worker",)),
    MetricSpec("num_requests_running", "gauge", "Requests running (router: relayed; workers: in a batch).",
               (ROUTER, PREFILL, DECODE)),
    MetricSpec("num_requests_waiting", "gauge", "Requests waiting (router: for a worker; prefill workers: for a "
               "step; decode workers: for their KV transfer, blocks or a seat, or preempted).",
               (ROUTER, PREFILL, DECODE)),
    # -- prefill worker ---------------------------------------------------------------------
    _h("prefill_time_seconds", "Prefill compute time of one request (seconds): the wall time of every prefill step "
       "it was in, summed (a step that batched several requests counts whole for each).", (PREFILL,), _LATENCY_S),
    _h("prefill_step_seconds", "Wall time of one prefill step (seconds).", (PREFILL,), _LATENCY_S),
    _h("prefill_batch_tokens", "Tokens computed in one prefill step.", (PREFILL,), _TOKENS),
    MetricSpec("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.", (PREFILL,)),
    MetricSpec("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.", (PREFILL,)),
    MetricSpec("kv_transfer_bytes", "counter", "KV bytes sent to decode workers, in whole blocks (a prompt's "
               "partial last block counts full).", (PREFILL,)),
    _h("kv_transfer_seconds", "Wall time of one request's KV transfer (seconds).", (PREFILL,), _LATENCY_S),
    MetricSpec("kv_transfer_failures", "counter", "Failed KV transfers by reason (the failure's status).",
               (PREFILL,), labels=("reason",)),
    # -- decode worker ----------------------------------------------------------------------
    _h("decode_time_seconds", "Wall time of one decode step (seconds).", (DECODE,), _LATENCY_S),
    _h("decode_batch_size", "Requests in one decode step.", (DECODE,), _BATCH),
    MetricSpec("num_preemptions", "counter", "Requests preempted (their blocks taken back).", (DECODE,)),
    MetricSpec("num_kv_recomputes", "counter",
               "Requests whose KV transfer failed and whose prompt KV was recomputed on the decode worker instead "
               "(preemptions are counted by num_preemptions).", (DECODE,)),
    MetricSpec("kv_received_bytes", "counter", "KV bytes received from prefill workers, in whole blocks (a "
               "prompt's partial last block counts full).", (DECODE,)),
    _h("kv_reservation_wait_seconds", "Time a request waited for its KV blocks on the decode worker (seconds).",
       (DECODE,), _LATENCY_S),
    # -- both workers -----------------------------------------------------------------------
    MetricSpec("kv_cache_usage_perc", "gauge", "KV-cache usage: used blocks / all blocks (fraction, 0-1).",
               WORKERS),
)

_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


def spec(name: str) -> MetricSpec:
    """The declaration of ``name``.

    Raises:
        KeyError: no metric is declared under ``name``.
    """
    for m in METRICS:
        if m.name == name:
            return m
    raise KeyError(f"no metric {name!r} is declared in serving.metrics.METRICS")


class ProcessMetrics:
    """The metrics one process exports, bound to its ``role`` / ``worker_id`` / ``model_name``.

    A colocated worker (one engine doing both halves) exports the prefill and decode sets.

    Args:
        role: ``router``, ``prefill``, ``decode`` or ``colocated``.
        worker_id: this process' id (the router's is ``"router"``).
        model_name: the served model's name.
        registry: where the collectors live (a fresh registry by default, so several
            processes' worth can coexist in one test interpreter).
    """

    def __init__(self, role: str, worker_id: str, model_name: str, registry: CollectorRegistry | None = None):
        disable_created_metrics()  # as vLLM: no ``_created`` series beside each counter and histogram
        self.registry = registry if registry is not None else CollectorRegistry()
        roles = {PREFILL, DECODE} if role == "colocated" else {role}
        if not roles & {ROUTER, PREFILL, DECODE}:
            raise ValueError(f"role must be router, prefill, decode or colocated, got {role!r}")
        self.base = {"role": role, "worker_id": worker_id, "model_name": model_name}
        self._metrics = {}
        self._children: dict[tuple, object] = {}  # (name, label items) -> child: labels() costs ~10 us a call
        self._children_lock = threading.Lock()
        for m in METRICS:
            if roles & set(m.roles):
                kwargs = {"buckets": m.buckets} if m.kind == "histogram" else {}
                self._metrics[m.name] = _KINDS[m.kind](PREFIX + m.name, m.help, BASE_LABELS + m.labels,
                                                       registry=self.registry, **kwargs)
                if not m.labels:  # the series exists (at 0) from the start, so queries over it return data
                    self._metrics[m.name].labels(**self.base)
                for value in m.preset:
                    self._metrics[m.name].labels(**self.base, **{m.labels[0]: value})

    def __contains__(self, name: str) -> bool:
        return name in self._metrics

    def get(self, name: str, **labels: str):
        """The child series of ``name`` for this process (``labels`` = the metric's own labels).

        Raises:
            KeyError: ``name`` is not exported by this process' role.
            ValueError: ``labels`` do not match the declaration.
        """
        key = (name, *labels.items())
        child = self._children.get(key)
        if child is None:
            if name not in self._metrics:
                raise KeyError(f"metric {name!r} is not exported by role {self.base['role']!r}")
            with self._children_lock:  # against clear(): no child it removed stays cached
                child = self._children[key] = self._metrics[name].labels(**self.base, **labels)
        return child

    def observe(self, name: str, value: float, **labels: str) -> None:
        """Histogram observation (seconds, tokens or bytes, as the name says)."""
        self.get(name, **labels).observe(value)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """Counter increment."""
        self.get(name, **labels).inc(amount)

    def set(self, name: str, value: float, **labels: str) -> None:
        """Gauge value."""
        self.get(name, **labels).set(value)

    def clear(self, name: str) -> None:
        """Remove every series of ``name`` (a gauge whose source went away).

        Raises:
            KeyError: ``name`` is not exported by this process' role.
        """
        if name not in self._metrics:
            raise KeyError(f"metric {name!r} is not exported by role {self.base['role']!r}")
        with self._children_lock:  # a cleared series is created anew when next set
            self._metrics[name].clear()
            for key in [k for k in self._children if k[0] == name]:
                del self._children[key]
