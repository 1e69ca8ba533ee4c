"""Load-test metrics, following vLLM's ``benchmarks/serve.py`` and DistServe (OSDI'24).

Per request (client side, see :class:`records.RequestRecord`):

* TTFT = arrival -> first token; E2E = arrival -> last token;
* TPOT = (E2E - TTFT) / (output tokens - 1); undefined for a one-token output, which is
  then left out of the TPOT statistics and counts as meeting a TPOT SLO (as in vLLM);
* ITL = every gap between consecutive streamed tokens, pooled over all requests.

Latency statistics are over completed requests only; percentiles use numpy's default
linear interpolation. Over a run of ``duration_s`` seconds (first send -> last stream end):

* request throughput = completed / duration (req/s); output throughput = output tokens
  of completed requests / duration (tokens/s);
* SLO attainment = share of *sent* requests that completed and met every given SLO
  (failed requests count as misses);
* goodput = completed requests meeting every SLO / duration (req/s): vLLM's per-run
  "request goodput". DistServe's goodput, the highest request rate whose SLO attainment
  stays >= a target (e.g. 90 %), needs a rate sweep: :func:`max_rate_meeting`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)
SLO_KEYS = ("ttft", "tpot", "e2e")


class InvariantError(RuntimeError):
    """completed + failed != sent: a request was lost by the load tester."""


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds; ``None`` = not constrained."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for key in SLO_KEYS:
            v = getattr(self, f"{key}_s")
            if v is not None and not v > 0:
                raise ValueError(f"SLO {key} must be > 0 seconds, got {v}")

    @property
    def empty(self) -> bool:
        """No objective given."""
        return all(getattr(self, f"{k}_s") is None for k in SLO_KEYS)

    def as_ms(self) -> dict[str, float]:
        """The given objectives in milliseconds, e.g. ``{"ttft_ms": 2000.0}``."""
        return {f"{k}_ms": getattr(self, f"{k}_s") * 1e3 for k in SLO_KEYS if getattr(self, f"{k}_s") is not None}

    def scaled(self, factor: float) -> "SLO":
        """Every given objective times ``factor`` (DistServe's SLO scale; > 0).

        Raises:
            ValueError: ``factor`` <= 0.
        """
        return SLO(**{f"{k}_s": None if getattr(self, f"{k}_s") is None else factor * getattr(self, f"{k}_s")
                      for k in SLO_KEYS})

    def met_by(self, rec: RequestRecord) -> bool:
        """``rec`` completed and meets every given objective."""
        if not rec.ok:
            return False
        checks = ((self.ttft_s, rec.ttft_s), (self.tpot_s, rec.tpot_s), (self.e2e_s, rec.e2e_s))
        return all(limit is None or value is None or value <= limit for limit, value in checks)


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s)\s*$")


def parse_duration_s(text: str) -> float:
    """``"2s"`` -> 2.0, ``"200ms"`` -> 0.2 (seconds).

    Raises:
        ValueError: no number with a unit ``s`` or ``ms``.
    """
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"bad duration {text!r}: expected a number with unit s or ms, e.g. 2s or 200ms")
    value = float(m.group(1))
    return value / 1e3 if m.group(2) == "ms" else value


def parse_slo(text: str) -> SLO:
    """Parse ``"ttft=2s,tpot=200ms"`` (any subset of ttft, tpot, e2e).

    Raises:
        ValueError: unknown key, repeated key or bad duration.
    """
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: expected KEY=DURATION with KEY in {SLO_KEYS}")
        if key in values:
            raise ValueError(f"SLO {key} given twice")
        values[key] = parse_duration_s(val)
    return SLO(**{f"{k}_s": v for k, v in values.items()})


def latency_stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p95, p99 of ``values_s`` (seconds) in milliseconds; ``None`` when empty."""
    if not len(values_s):
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    pct = np.percentile(a, PERCENTILES)
    return {"mean": float(a.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)}}


def pooled_itls_s(records: Sequence[RequestRecord]) -> list[float]:
    """All inter-token gaps (seconds) of the completed requests, pooled."""
    return [gap for r in records if r.ok for gap in r.itls_s]


def summarize(records: Sequence[RequestRecord], sent: int, duration_s: float, slo: SLO | None = None) -> dict:
    """Aggregate metrics of one run (keys documented in ``docs/loadtest.md``).

    ``sent`` is the load tester's own count of requests sent; ``duration_s`` (seconds) the
    span from the first send to the last stream end.

    Raises:
        InvariantError: completed + failed != sent (a request was lost).
    """
    ok = [r for r in records if r.ok]
    completed, failed = len(ok), len(records) - len(ok)
    if completed + failed != sent:
        raise InvariantError(f"completed ({completed}) + failed ({failed}) != sent ({sent}): "
                             f"{sent - completed - failed} request(s) lost")
    out_tokens = sum(r.output_tokens for r in ok)
    rate = (lambda n: n / duration_s if duration_s > 0 else 0.0)
    summary = {
        "sent": sent,
        "completed": completed,
        "failed": failed,
        "duration_s": duration_s,
        "request_throughput": rate(completed),
        "output_throughput": rate(out_tokens),
        "total_input_tokens": sum(r.input_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "ttft_ms": latency_stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": latency_stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": latency_stats_ms(pooled_itls_s(ok)),
        "e2e_ms": latency_stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "errors": dict(sorted(Counter(r.status for r in records if not r.ok).items())),
        "output_token_mismatches": sum(1 for r in ok if r.output_tokens != r.expected_output_tokens),
        "max_send_lag_ms": max((r.arrival_s - r.scheduled_s for r in records), default=0.0) * 1e3,
    }
    if slo is not None and not slo.empty:
        good = sum(1 for r in records if slo.met_by(r))
        summary.update(slo=slo.as_ms(), slo_attainment=good / sent if sent else 0.0, goodput=rate(good))
    summary.update(vllm_bench_keys(summary))
    return summary


def vllm_bench_keys(summary: dict) -> dict:
    """The same figures under the key names of ``vllm bench serve``'s result JSON
    (``median_ttft_ms``, ``p99_itl_ms``, ``mean_e2el_ms``, ``request_goodput``,
    ``total_token_throughput``, ...), so one script reads either tool's output."""
    out = {"duration": summary["duration_s"],
           "total_token_throughput": (summary["total_input_tokens"] + summary["total_output_tokens"])
           / summary["duration_s"] if summary["duration_s"] > 0 else 0.0}
    if "goodput" in summary:
        out["request_goodput"] = summary["goodput"]
    for ours, theirs in (("ttft_ms", "ttft"), ("tpot_ms", "tpot"), ("itl_ms", "itl"), ("e2e_ms", "e2el")):
        stats = summary[ours]
        out[f"mean_{theirs}_ms"] = stats["mean"]
        out[f"median_{theirs}_ms"] = stats["p50"]
        for p in PERCENTILES:
            out[f"p{p}_{theirs}_ms"] = stats[f"p{p}"]
    return out


def max_rate_meeting(rates: Sequence[float], attainments: Sequence[float], target: float = 0.9) -> float | None:
    """DistServe goodput from a rate sweep: the highest swept rate (req/s) such that it and
    every lower swept rate reach SLO attainment >= ``target``; ``None`` if the lowest fails.

    Raises:
        ValueError: ``rates`` and ``attainments`` differ in length, or ``target`` not in (0, 1].
    """
    if len(rates) != len(attainments):
        raise ValueError("rates and attainments must have the same length")
    if not 0 < target <= 1:
        raise ValueError("target must be in (0, 1]")
    best = None
    for rate, att in sorted(zip(rates, attainments)):
        if att < target:
            break
        best = rate
    return best
