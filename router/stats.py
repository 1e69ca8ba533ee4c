"""Per-request latency and token statistics on the router, recorded as Prometheus metrics.

Definitions (vLLM's, ``vllm/v1/metrics/stats.py``; DistServe's TTFT/TPOT):

* queue time: arrival at the router → the decode worker granted the reservation
  (blocks admitted; backpressure shows here): vLLM's "scheduled" moment;
* prefill time: the reservation → the first output token (the prefill worker's queue, its
  compute and the KV transfer); decode time: the first → the last token; inference time:
  the reservation → the last token (the sum of the two), of finished requests;
* TTFT: arrival → the first output token left the router;
* ITL: time between consecutive token messages of one request;
* TPOT: (E2E − TTFT) / (generated tokens − 1), for requests of two tokens or more;
* E2E: arrival → the final message.

Token counters count as vLLM's do, per step rather than per finished request: a request's
prompt tokens once its first token left the router (once, whatever migrations follow), its
generated tokens as they leave; so a cancelled or failed request's work is counted too, and
``rate(generation_tokens_total)`` follows the output as it streams. The length histograms
(``request_prompt_tokens``, ``request_generation_tokens``) are of finished requests. Every
request that leaves the router counts exactly once in ``request_success`` or ``request_errors``
(a front door that stops reading a stream, the client having gone, counts ``CANCELLED``).

All times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import threading
import time

from serving.metrics import ProcessMetrics


class RouterGauges:
    """Requests waiting for a reservation and requests relaying tokens (thread-safe)."""

    def __init__(self, metrics: ProcessMetrics) -> None:
        self._m = metrics
        self._lock = threading.Lock()
        self._n = {"num_requests_waiting": 0, "num_requests_running": 0}

    def add(self, name: str, delta: int) -> None:
        with self._lock:
            self._n[name] += delta
            self._m.set(name, self._n[name])


class RequestStats:
    """Statistics of one request; every method is called from its handler thread only."""

    def __init__(self, metrics: ProcessMetrics, gauges: RouterGauges, num_prompt_tokens: int,
                 max_tokens: int = 0) -> None:
        self._m = metrics
        self._g = gauges
        self.arrival_s = time.monotonic()
        self.reserved_s: float | None = None
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens  # the request's own, its default resolved (0: not known)
        self.num_tokens = 0
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self._state = "waiting"
        self._g.add("num_requests_waiting", 1)

    @property
    def ended(self) -> bool:
        """Whether :meth:`finished` or :meth:`failed` recorded the request's outcome."""
        return self._state == "done"

    def reserved(self) -> None:
        """The decode worker admitted the request (queue time ends)."""
        if self._state == "waiting":
            self.reserved_s = time.monotonic()
            self._m.observe("request_queue_time_seconds", self.reserved_s - self.arrival_s)
            self._move("running")

    def tokens(self, n: int) -> None:
        """``n`` output tokens left the router in one message."""
        if n <= 0:
            return
        now = time.monotonic()
        if self.first_token_s is None:
            self.first_token_s = now
            self._m.observe("time_to_first_token_seconds", now - self.arrival_s)
            self._m.inc("prompt_tokens", self.num_prompt_tokens)
        else:
            self._m.observe("inter_token_latency_seconds", now - self.last_token_s)
        self.last_token_s = now
        self.num_tokens += n
        self._m.inc("generation_tokens", n)

    def finished(self, reason: str) -> None:
        """The request ended normally (``reason``: ``stop``, ``length`` or ``abort``); once
        the request has ended (here or in :meth:`failed`), nothing more is recorded."""
        if self.ended:
            return
        now = time.monotonic()
        m = self._m
        m.observe("e2e_request_latency_seconds", now - self.arrival_s)
        m.observe("request_prompt_tokens", self.num_prompt_tokens)
        m.observe("request_generation_tokens", self.num_tokens)
        if self.max_tokens:
            m.observe("request_params_max_tokens", self.max_tokens)
        if self.reserved_s is not None and self.first_token_s is not None:
            m.observe("request_prefill_time_seconds", self.first_token_s - self.reserved_s)
            m.observe("request_decode_time_seconds", self.last_token_s - self.first_token_s)
            m.observe("request_inference_time_seconds", self.last_token_s - self.reserved_s)
        if self.num_tokens > 1 and self.first_token_s is not None:
            m.observe("request_time_per_output_token_seconds",
                      (self.last_token_s - self.first_token_s) / (self.num_tokens - 1))
        m.inc("request_success", finished_reason=reason)
        self._move("done")

    def failed(self, code: str) -> None:
        """The request ended with the gRPC status ``code`` (e.g. ``UNAVAILABLE``), unless it has
        ended already."""
        if self.ended:
            return
        self._m.inc("request_errors", code=code)
        self._move("done")

    def close(self) -> None:
        """The request left the router (after :meth:`finished` / :meth:`failed`, or cut short)."""
        self._move("done")

    def _move(self, state: str) -> None:
        if self._state == "done":
            return
        self._g.add(f"num_requests_{self._state}", -1)
        if state != "done":
            self._g.add(f"num_requests_{state}", 1)
        self._state = state
