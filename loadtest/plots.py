"""PNG plots of a load test (matplotlib, no display needed).

* ``cdf.png``: empirical CDFs of TTFT and of the pooled ITL (ms);
* ``latency_over_time.png``: TTFT and E2E (ms) of each request against its arrival (s);
* ``throughput_over_time.png``: output tokens/s and requests/s sent and completed per time bin;
* ``overview.png``: the four panels in one figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from loadtest.metrics import pooled_itls_s
from loadtest.records import RequestRecord

_DPI = 110


def _cdf(ax: Axes, values_ms: Sequence[float], title: str, color: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if not len(values_ms):
        ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes)
        return
    x = np.sort(np.asarray(values_ms))
    ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", color=color)
    for p in (50, 99):
        v = float(np.percentile(x, p))
        ax.axvline(v, color="gray", ls=":", lw=1)
        ax.annotate(f"p{p} {v:.0f}", (v, 0.05 if p == 50 else 0.15), fontsize=8, color="dimgray")


def _latency(ax: Axes, records: Sequence[RequestRecord]) -> None:
    ok = [r for r in records if r.ok]
    ax.set_title("latency by arrival time")
    ax.set_xlabel("arrival (s since start)")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3)
    ax.scatter([r.arrival_s for r in ok], [r.e2e_s * 1e3 for r in ok], s=10, label="E2E", color="tab:blue")
    ax.scatter([r.arrival_s for r in ok], [r.ttft_s * 1e3 for r in ok], s=10, label="TTFT", color="tab:orange")
    failed = [r for r in records if not r.ok]
    if failed:
        ax.scatter([r.arrival_s for r in failed], [0.0] * len(failed), marker="x", color="tab:red", label="failed")
    ax.legend(fontsize=8)


def _throughput(ax: Axes, records: Sequence[RequestRecord], duration_s: float) -> None:
    ax.set_title("throughput over time")
    ax.set_xlabel("time (s since start)")
    ax.grid(alpha=0.3)
    width = max(1.0, duration_s / 30)
    edges = np.arange(0.0, max(duration_s, width) + width, width)
    centers = edges[:-1] + width / 2
    tokens = np.histogram([t for r in records for t in r.token_times_s], edges)[0] / width
    ax.plot(centers, tokens, color="tab:green", label="output tokens/s")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    sent = np.histogram([r.arrival_s for r in records], edges)[0] / width
    done = np.histogram([r.end_s for r in records if r.ok and r.end_s is not None], edges)[0] / width
    ax2.step(centers, sent, where="mid", color="tab:gray", ls="--", label="sent req/s")
    ax2.step(centers, done, where="mid", color="tab:purple", label="completed req/s")
    ax2.set_ylabel("req/s")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    return path


def write_plots(records: Sequence[RequestRecord], duration_s: float, out_dir: Path) -> list[Path]:
    """Write the four PNGs into ``out_dir``; returns their paths."""
    ok = [r for r in records if r.ok]
    ttft_ms = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    itl_ms = [g * 1e3 for g in pooled_itls_s(records)]
    paths = []
    fig = Figure(figsize=(10, 4))
    a, b = fig.subplots(1, 2)
    _cdf(a, ttft_ms, "TTFT CDF", "tab:orange")
    _cdf(b, itl_ms, "ITL CDF (pooled)", "tab:blue")
    paths.append(_save(fig, out_dir / "cdf.png"))
    fig = Figure(figsize=(7, 4))
    _latency(fig.subplots(), records)
    paths.append(_save(fig, out_dir / "latency_over_time.png"))
    fig = Figure(figsize=(7, 4))
    _throughput(fig.subplots(), records, duration_s)
    paths.append(_save(fig, out_dir / "throughput_over_time.png"))
    fig = Figure(figsize=(12, 8))
    axes = fig.subplots(2, 2)
    _cdf(axes[0][0], ttft_ms, "TTFT CDF", "tab:orange")
    _cdf(axes[0][1], itl_ms, "ITL CDF (pooled)", "tab:blue")
    _latency(axes[1][0], records)
    _throughput(axes[1][1], records, duration_s)
    paths.append(_save(fig, out_dir / "overview.png"))
    return paths
