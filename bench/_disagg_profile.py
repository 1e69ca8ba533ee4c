"""Where a run's time goes: the cluster's own Prometheus histograms (``serving.metrics``), read
from the router and every live worker right before and right after a run of
``bench/disagg_vs_colocated.py``, turned into per-run means (the profile its analysis cites when
a target is missed).

A histogram's ``_sum`` and ``_count`` are summed over the processes of one side (the router; the
workers, whatever their role: a colocated worker exposes both the prefill and the decode ones),
and the profile is the difference after - before:

* ``ttft_mean_ms``: the router's TTFT (arrival at the router to first token);
* ``prefill_queue_mean_ms``: a request's wait at its worker before its prefill began;
* ``prefill_time_mean_ms``: a request's prefill compute, summed over its steps (with every other
  request of those steps: a prompt's first token comes at its last step's end);
* ``prefill_step_mean_ms``, ``prefill_step_tokens_mean`` and ``prefill_tokens_per_s`` (tokens
  computed over the steps' summed wall time): the prefill steps' size and speed;
* ``prefill_busy`` / ``decode_busy``: summed step wall time over the run's wall time (1.0: one
  worker stepping the whole run; summed over workers);
* ``decode_step_mean_ms``, ``decode_batch_mean``: the decode steps;
* ``kv_transfer_mean_ms``: one request's KV transfer (disaggregated only; ``None`` otherwise).
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = ("time_to_first_token_seconds", "request_queue_time_seconds", "prefill_time_seconds",
              "prefill_step_seconds", "prefill_batch_tokens", "decode_time_seconds", "decode_batch_size",
              "kv_transfer_seconds")
"""The histograms (``pdcluster:`` names without the prefix) a profile reads."""

COLUMNS = (("ttft_mean_ms", "TTFT mean (ms)", "{:.0f}"), ("prefill_queue_mean_ms", "prefill queue mean (ms)", "{:.0f}"),
           ("prefill_time_mean_ms", "prefill time / request (ms)", "{:.0f}"),
           ("prefill_step_mean_ms", "prefill step (ms)", "{:.0f}"),
           ("prefill_step_tokens_mean", "tokens / prefill step", "{:.0f}"),
           ("prefill_tokens_per_s", "prefill tok/s in steps", "{:.0f}"), ("prefill_busy", "prefill busy", "{:.2f}"),
           ("decode_step_mean_ms", "decode step (ms)", "{:.1f}"), ("decode_batch_mean", "decode batch", "{:.1f}"),
           ("decode_busy", "decode busy", "{:.2f}"), ("kv_transfer_mean_ms", "KV transfer (ms)", "{:.0f}"))
"""(profile key, column title, format) of the report's profile table."""


def scrape(address: str, timeout_s: float = 10.0) -> dict[str, float]:
    """``{"<histogram>_sum" | "<histogram>_count": value}`` of :data:`HISTOGRAMS` at
    ``http://address/metrics``, summed over label sets.

    Raises:
        OSError: the endpoint cannot be read.
    """
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as r:
        body = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        name = family.name.removeprefix("pdcluster:")
        if name not in HISTOGRAMS:
            continue
        for s in family.samples:
            if s.name.endswith(("_sum", "_count")):
                key = name + s.name[s.name.rindex("_"):]
                out[key] = out.get(key, 0.0) + s.value
    return out


def snapshot(state: dict) -> dict[str, dict[str, float]] | None:
    """``{"router": ..., "workers": ...}``: :func:`scrape` of the router and of every live worker
    (summed); ``None`` when an endpoint cannot be read (the run then has no profile)."""
    from serving.registry import WorkerRegistry

    try:
        workers: dict[str, float] = {}
        for info, _ in WorkerRegistry(state["redis_url"], state["cluster"]).live_workers():
            for k, v in scrape(info.metrics_address).items():
                workers[k] = workers.get(k, 0.0) + v
        return {"router": scrape(state["router_http_address"]), "workers": workers}
    except (OSError, KeyError, ValueError):
        return None


def _mean(before: dict, after: dict, name: str, scale: float = 1.0) -> float | None:
    n = after.get(name + "_count", 0.0) - before.get(name + "_count", 0.0)
    return None if n <= 0 else scale * (after.get(name + "_sum", 0.0) - before.get(name + "_sum", 0.0)) / n


def _delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def profile(before: dict | None, after: dict | None, wall_s: float) -> dict[str, float | None]:
    """The run's profile (the module doc's keys) from two :func:`snapshot` readings ``wall_s``
    seconds apart; ``{}`` when either is missing."""
    if before is None or after is None:
        return {}
    r0, r1, w0, w1 = before["router"], after["router"], before["workers"], after["workers"]
    step_s, tokens = _delta(w0, w1, "prefill_step_seconds_sum"), _delta(w0, w1, "prefill_batch_tokens_sum")
    return {
        "ttft_mean_ms": _mean(r0, r1, "time_to_first_token_seconds", 1e3),
        "prefill_queue_mean_ms": _mean(w0, w1, "request_queue_time_seconds", 1e3),
        "prefill_time_mean_ms": _mean(w0, w1, "prefill_time_seconds", 1e3),
        "prefill_step_mean_ms": _mean(w0, w1, "prefill_step_seconds", 1e3),
        "prefill_step_tokens_mean": _mean(w0, w1, "prefill_batch_tokens"),
        "prefill_tokens_per_s": tokens / step_s if step_s > 0 else None,
        "prefill_busy": step_s / wall_s if wall_s > 0 else None,
        "decode_step_mean_ms": _mean(w0, w1, "decode_time_seconds", 1e3),
        "decode_batch_mean": _mean(w0, w1, "decode_batch_size"),
        "decode_busy": _delta(w0, w1, "decode_time_seconds_sum") / wall_s if wall_s > 0 else None,
        "kv_transfer_mean_ms": _mean(w0, w1, "kv_transfer_seconds", 1e3),
    }


def mean_profile(runs: list[dict]) -> dict[str, float | None]:
    """Per key of :data:`COLUMNS`, the mean over the runs that have a value (``None``: none has)."""
    out: dict[str, float | None] = {}
    for key, _, _ in COLUMNS:
        values = [r["profile"][key] for r in runs if r.get("profile", {}).get(key) is not None]
        out[key] = sum(values) / len(values) if values else None
    return out
