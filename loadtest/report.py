"""Write and show a load test's results: ``requests.jsonl`` (one record per request),
``summary.json``, ``report.md`` and a rich summary table for the terminal."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Group
from rich.table import Table

from loadtest.records import RequestRecord

LATENCY_KEYS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
STAT_KEYS = ("mean", "p50", "p90", "p95", "p99")


def write_records(path: Path, records: Sequence[RequestRecord]) -> None:
    """One JSON object per line per request (times in seconds since the run start)."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r.as_dict()) + "\n")


def write_summary(path: Path, summary: dict) -> None:
    """``summary`` as indented JSON."""
    path.write_text(json.dumps(summary, indent=2) + "\n")


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def _headline(summary: dict) -> list[tuple[str, str]]:
    rows = [
        ("requests sent / completed / failed", f"{summary['sent']} / {summary['completed']} / {summary['failed']}"),
        ("duration", f"{summary['duration_s']:.2f} s"),
        ("request throughput", f"{summary['request_throughput']:.3f} req/s"),
        ("output token throughput", f"{summary['output_throughput']:.1f} tokens/s"),
    ]
    if "slo_attainment" in summary:
        slo = ", ".join(f"{k.removesuffix('_ms')} ≤ {v:g} ms" for k, v in summary["slo"].items())
        rows += [("SLO", slo), ("SLO attainment", f"{100 * summary['slo_attainment']:.1f} %"),
                 ("goodput", f"{summary['goodput']:.3f} req/s")]
    if summary.get("errors"):
        rows.append(("errors", ", ".join(f"{k}: {v}" for k, v in summary["errors"].items())))
    clip = summary.get("clipping")
    if clip and any(clip.values()):
        rows.append(("clipped", f"{clip['inputs_clipped']} inputs (-{clip['input_tokens_removed']} tokens), "
                                f"{clip['outputs_clipped']} outputs (-{clip['output_tokens_removed']} tokens)"))
    return rows


def summary_table(summary: dict) -> Group:
    """Two rich tables: headline numbers, then latency statistics in ms."""
    head = Table(title="load test summary", show_header=False)
    head.add_column("metric", style="bold")
    head.add_column("value")
    for label, value in _headline(summary):
        head.add_row(label, value)
    lat = Table(show_header=True, header_style="bold")
    lat.add_column("latency (ms)")
    for k in STAT_KEYS:
        lat.add_column(k, justify="right")
    for key, label in LATENCY_KEYS:
        lat.add_row(label, *[_ms(summary[key][s]) for s in STAT_KEYS])
    return Group(head, lat)


def write_markdown(path: Path, summary: dict, plots: Sequence[Path] = (), config: dict | None = None) -> None:
    """A markdown report: configuration, headline numbers, latency table, plots."""
    lines = ["# Load test report", ""]
    if config:
        lines += ["## Configuration", "", "| option | value |", "|---|---|"]
        lines += [f"| {k} | `{v}` |" for k, v in config.items()]
        lines.append("")
    lines += ["## Results", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _headline(summary)]
    lines += ["", "| latency (ms) | " + " | ".join(STAT_KEYS) + " |", "|---" * (len(STAT_KEYS) + 1) + "|"]
    for key, label in LATENCY_KEYS:
        lines.append(f"| {label} | " + " | ".join(_ms(summary[key][s]) for s in STAT_KEYS) + " |")
    lines += ["", "TTFT = arrival → first token, TPOT = (E2E − TTFT)/(output tokens − 1), ITL = every gap "
              "between streamed tokens (pooled), E2E = arrival → last token (vLLM benchmarks/serve.py); "
              "goodput = completed requests meeting every SLO / duration.", ""]
    if summary.get("output_token_mismatches"):
        lines += [f"**{summary['output_token_mismatches']} completed request(s) returned a different number of "
                  "tokens than requested.**", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    path.write_text("\n".join(lines))
