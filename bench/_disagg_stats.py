"""Pure statistics and decisions of ``bench/disagg_vs_colocated.py`` (no cluster, no I/O).

* :func:`mean_ci`: mean and Student-t 95 % confidence interval over repetitions;
* :func:`aggregate_point`: those for every compared metric of one (workload, mode, rate);
* :func:`itl_by_gap`: where in the streams the p99 inter-token latency comes from;
* :func:`gate_value` / :func:`wait_for_load`: the load gate before a measured run;
* :func:`distserve_goodput` / :func:`should_stop` / :func:`targets`: the sweep's decisions;
* :func:`attainment_by_scale` / :func:`goodput_by_scale`: attainment and DistServe goodput with
  every objective of the SLO scaled (DistServe's "SLO scale" axis, Zhong et al., OSDI 2024, §6),
  recomputed from a run's per-request records.

Units are in the names (``_ms`` milliseconds, ``_s`` seconds); rates and goodputs are req/s,
attainments fractions in [0, 1], loads the kernel's 1-minute load average (runnable tasks).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence

from loadtest.metrics import SLO, latency_stats_ms, max_rate_meeting
from loadtest.records import RequestRecord

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
        2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Two-sided 95 % Student t quantiles (t_{0.975, df}) for df = 1..30 (standard tables);
beyond 30 degrees of freedom the df = 30 value is used (conservative: it exceeds the true
quantile, which tends to 1.960)."""

COMPARED = ("goodput", "slo_attainment", "itl_p99_ms", "ttft_p99_ms")
"""Per-run metrics given with mean and 95 % CI: vLLM goodput (req/s), SLO attainment
(fraction), p99 inter-token latency and p99 time to first token (ms)."""

GAPS = ("first_gap_p99_ms", "middle_gap_p99_ms", "last_gap_p99_ms")
"""Per-run p99 of the inter-token gaps by position in a stream (ms; :func:`itl_by_gap`),
given with mean and 95 % CI next to :data:`COMPARED` (a diagnostic, not a target)."""

ITL_RATIO_TARGET = 0.5
"""Target: disaggregated p99 ITL <= this times colocated's at the comparison rate."""


def t_quantile_975(df: int) -> float:
    """t_{0.975, df} from :data:`T975`.

    Raises:
        ValueError: ``df < 1``.
    """
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    return T975[min(df, len(T975)) - 1]


def mean_ci(values: Sequence[float | None]) -> dict:
    """Mean and 95 % confidence interval of the non-None ``values`` (one per repetition).

    Returns:
        ``{"n", "mean", "ci95_half", "ci95_low", "ci95_high", "values"}``: ``ci95_half`` is
        ``t_{0.975, n-1} * s / sqrt(n)`` (``s`` the sample standard deviation); the
        interval fields are None when ``n < 2``, and ``mean`` is None when ``n == 0``.
    """
    xs = [float(v) for v in values if v is not None]
    n = len(xs)
    out = {"n": n, "mean": statistics.fmean(xs) if xs else None, "ci95_half": None, "ci95_low": None,
           "ci95_high": None, "values": list(values)}
    if n >= 2:
        half = t_quantile_975(n - 1) * statistics.stdev(xs) / math.sqrt(n)
        out.update(ci95_half=half, ci95_low=out["mean"] - half, ci95_high=out["mean"] + half)
    return out


def aggregate_point(runs: Sequence[dict]) -> dict:
    """``{metric: mean_ci(...)}`` for every metric of :data:`COMPARED` and :data:`GAPS` over the
    recorded runs of one point (a run whose p99 is missing, no request completed, counts as missing)."""
    return {key: mean_ci([r.get(key) for r in runs]) for key in COMPARED + GAPS}


def itl_by_gap(token_times_s: Iterable[Sequence[float]]) -> dict:
    """p99 of the inter-token gaps of one run's completed streams, by position (ms).

    Args:
        token_times_s: per stream, the times its tokens arrived (seconds, ascending).

    Returns:
        ``{"first_gap_p99_ms", "middle_gap_p99_ms", "last_gap_p99_ms"}``: ``first`` is the gap
        from the first token to the second (in disaggregated mode the KV transfer and the decode
        worker's admission), ``last`` the final gap of a stream of >= 3 tokens, ``middle`` the
        others; None where no stream has such a gap. A pooled ITL p99 dominated by one position
        points at its cause (e.g. a final token held back) rather than at decode steps.
    """
    first: list[float] = []
    middle: list[float] = []
    last: list[float] = []
    for times in token_times_s:
        gaps = [b - a for a, b in zip(times, times[1:])]
        if gaps:
            first.append(gaps[0])
        if len(gaps) >= 2:
            last.append(gaps[-1])
            middle += gaps[1:-1]
    return {key: latency_stats_ms(v)["p99"] for key, v in zip(GAPS, (first, middle, last))}


def gate_value(load_1m: float, idle_baseline: float) -> float:
    """The load the gate compares with ``--max-load``: the 1-minute load average minus the
    idle cluster's own share (``idle_baseline``, cores; never below 0)."""
    return load_1m - max(0.0, idle_baseline)


def wait_for_load(read_load: Callable[[], float], sleep: Callable[[float], None], now: Callable[[], float], *,
                  max_load: float, idle_baseline: float, wait_s: float, poll_s: float = 10.0) -> dict:
    """Wait until ``gate_value(read_load(), idle_baseline) <= max_load``, for at most ``wait_s``.

    Args:
        read_load: returns the current 1-minute load average.
        sleep / now: ``time.sleep`` / ``time.monotonic`` (injected for tests).
        poll_s: seconds between readings (> 0).

    Returns:
        ``{"ok", "load_1m", "gate_value", "waited_s"}`` of the last reading: ``ok`` False
        means the point must not be recorded.

    Raises:
        ValueError: ``poll_s <= 0`` or ``wait_s < 0``.
    """
    if poll_s <= 0 or wait_s < 0:
        raise ValueError(f"poll_s must be > 0 and wait_s >= 0 (got {poll_s}, {wait_s})")
    start = now()
    while True:
        load = read_load()
        value = gate_value(load, idle_baseline)
        waited = now() - start
        if value <= max_load or waited >= wait_s:
            return {"ok": value <= max_load, "load_1m": load, "gate_value": value, "waited_s": waited}
        sleep(min(poll_s, max(0.0, wait_s - waited)))


def distserve_goodput(points: Sequence[dict], target: float) -> float | None:
    """DistServe's goodput of one (workload, mode): the highest rate such that it and every
    lower measured rate have mean SLO attainment >= ``target`` (points without a recorded
    run are left out); None when the lowest fails or nothing was recorded."""
    done = [p for p in points if p["stats"]["slo_attainment"]["mean"] is not None]
    return max_rate_meeting([p["rate"] for p in done], [p["stats"]["slo_attainment"]["mean"] for p in done],
                            target)


def should_stop(point: dict, threshold: float | None) -> bool:
    """True when the sweep stops raising the rate after this (colocated) point: its mean
    attainment is below ``threshold`` (never with ``threshold`` None or nothing recorded)."""
    mean = point["stats"]["slo_attainment"]["mean"]
    return threshold is not None and mean is not None and mean < threshold


def comparison_rate(colocated: Sequence[dict], target: float) -> float | None:
    """The rate the ITL target is judged at: the first rate where colocated's mean attainment
    drops below ``target``, else colocated's highest recorded rate; None with no record."""
    done = [p for p in sorted(colocated, key=lambda p: p["rate"]) if p["stats"]["slo_attainment"]["mean"] is not None]
    for p in done:
        if p["stats"]["slo_attainment"]["mean"] < target:
            return p["rate"]
    return done[-1]["rate"] if done else None


def _mean_at(points: Sequence[dict], rate: float, key: str) -> float | None:
    return next((p["stats"][key]["mean"] for p in points if p["rate"] == rate), None)


def targets(disagg: Sequence[dict], colocated: Sequence[dict], target: float) -> dict:
    """The two targets of one workload.

    Returns:
        ``{"itl": {"rate", "disagg_itl_p99_ms", "colocated_itl_p99_ms", "ratio", "limit", "met"},
        "goodput": {"disagg", "colocated", "met"}}``; ``met`` is None when a side has no
        measurement (a DistServe goodput of None counts as 0 req/s when the other side has one).
    """
    rate = comparison_rate(colocated, target)
    d = _mean_at(disagg, rate, "itl_p99_ms") if rate is not None else None
    c = _mean_at(colocated, rate, "itl_p99_ms") if rate is not None else None
    ratio = d / c if d is not None and c else None
    itl = {"rate": rate, "disagg_itl_p99_ms": d, "colocated_itl_p99_ms": c, "ratio": ratio,
           "limit": ITL_RATIO_TARGET, "met": None if ratio is None else ratio <= ITL_RATIO_TARGET}
    gd, gc = distserve_goodput(disagg, target), distserve_goodput(colocated, target)
    measured = any(p["runs"] for p in disagg) and any(p["runs"] for p in colocated)
    met = (gd or 0.0) >= (gc or 0.0) if measured else None
    return {"itl": itl, "goodput": {"disagg": gd, "colocated": gc, "met": met}}


def attainment_by_scale(records: Sequence[RequestRecord], slo: SLO, scales: Sequence[float]) -> dict:
    """SLO attainment of one run with every objective of ``slo`` multiplied by each scale
    (:meth:`loadtest.metrics.SLO.scaled`, counted by its ``met_by``).

    Args:
        records: the run's per-request records (``requests.jsonl``: every sent request).
        slo: the objectives at scale 1.
        scales: the multipliers.

    Returns:
        ``{f"{scale:g}": fraction of the records meeting every scaled objective}`` (0.0 with no
        record).
    """
    return {f"{sc:g}": (sum(map(slo.scaled(sc).met_by, records)) / len(records) if records else 0.0)
            for sc in scales}


def goodput_by_scale(points: Sequence[dict], scales: Sequence[float], target: float) -> dict:
    """Per SLO scale, DistServe goodput (:func:`distserve_goodput`'s rule on the mean over a point's
    runs of their ``attainment_by_slo_scale``) and ``at_highest``: it is the highest rate measured,
    so the true goodput may be higher (the sweep stopped there at scale 1).

    Returns:
        ``{f"{scale:g}": {"goodput": req/s or None, "at_highest": bool}}``.
    """
    out = {}
    for sc in (f"{s:g}" for s in scales):
        done = [(p["rate"], [r["attainment_by_slo_scale"][sc] for r in p["runs"]
                             if sc in r.get("attainment_by_slo_scale", {})]) for p in points]
        done = [(rate, sum(a) / len(a)) for rate, a in done if a]
        best = max_rate_meeting([r for r, _ in done], [a for _, a in done], target) if done else None
        out[sc] = {"goodput": best, "at_highest": best is not None and best == max(r for r, _ in done)}
    return out
