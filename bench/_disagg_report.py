"""Markdown and plot of ``bench/disagg_vs_colocated.py``'s result (the JSON document of its
``build_result``): per workload a table per mode with mean ± 95 % CI, and the targets table."""

from __future__ import annotations

from pathlib import Path

from _disagg_profile import COLUMNS, mean_profile
from loadtest.metrics import parse_slo
from _disagg_stats import GAPS

LABELS = (("goodput", "goodput (req/s)", 1.0, "{:.3f}"), ("slo_attainment", "SLO attainment (%)", 100.0, "{:.0f}"),
          ("itl_p99_ms", "ITL p99 (ms)", 1.0, "{:.0f}"), ("ttft_p99_ms", "TTFT p99 (ms)", 1.0, "{:.0f}"))
"""(metric, column title, scale, format) of the compared metrics."""


def _ci(stat: dict, scale: float, fmt: str) -> str:
    if stat["mean"] is None:
        return "–"
    text = fmt.format(scale * stat["mean"])
    if stat["ci95_half"] is not None:
        text += " ± " + fmt.format(scale * stat["ci95_half"])
    return text


def _met(met) -> str:
    return "n/a (not measured)" if met is None else ("**met**" if met else "**missed**")


def _rate(v) -> str:
    return "none" if v is None else f"{v:g} req/s"


def _mode_table(name: str, mode: dict, entry: dict, workload: str, result: dict) -> list[str]:
    lines = [f"### {name} (`{' '.join(entry['up_args'][workload])}`)", ""]
    cluster = entry.get("clusters", {}).get(workload, {})
    if cluster.get("skipped"):
        return lines + [f"**Not run:** {cluster['skipped']}", ""]
    base = cluster.get("idle_baseline", {})
    if entry.get("report_only"):
        lines += ["Built from recorded runs (`--report-only`): the session that recorded a run had warmed its "
                  "cluster up and measured its idle baseline first; the load before each run is below.", ""]
    else:
        lines += [f"Warm-up: {cluster.get('warmup')}. Idle cluster baseline: {base.get('cores', 0):.2f} cores "
                  f"({'measured' if base.get('measured') else 'given'}).", ""]
    lines += [
              "| rate (req/s) | recorded / reps | " + " | ".join(t for _, t, _, _ in LABELS)
              + " | 1-min load before each run | cluster CPU (cores) per run | skipped runs (load seen) |",
              "|" + "---|" * (5 + len(LABELS))]
    reps = result["config"]["repetitions"]
    for p in mode["points"]:
        loads = ", ".join(f"{r['load_1m_before']:.2f}" for r in p["runs"]) or "–"
        cpu = ", ".join(f"{r['cluster_cpu_cores']:.2f}" for r in p["runs"] if "cluster_cpu_cores" in r) or "–"
        skipped = ", ".join(f"rep {s['rep']}: {s['load_1m']:.2f}" for s in p["skipped_runs"]) or "–"
        cells = " | ".join(_ci(p["stats"][k], sc, f) for k, _, sc, f in LABELS)
        lines.append(f"| {p['rate']:g} | {len(p['runs'])}/{reps} | {cells} | {loads} | {cpu} | {skipped} |")
    target = result["config"]["attainment_target"]
    lines += ["", f"DistServe goodput (highest rate whose mean SLO attainment, and every lower rate's, is ≥ "
                  f"{100 * target:.0f} %): **{_rate(mode['distserve_goodput'])}**", ""]
    return lines


def _gap_table(w: dict) -> list[str]:
    """Per mode and rate, the p99 of the inter-token gaps by position (first / middle / last)."""
    lines = ["| mode | rate (req/s) | ITL p99 (ms) | first gap p99 (ms) | middle gaps p99 (ms) | last gap p99 (ms) |",
             "|---|---|---|---|---|---|"]
    for mode, m in w["modes"].items():
        for p in m["points"]:
            cells = " | ".join(_ci(p["stats"][k], 1.0, "{:.0f}") if k in p["stats"] else "–"
                               for k in ("itl_p99_ms", *GAPS))
            lines.append(f"| {mode} | {p['rate']:g} | {cells} |")
    return ["Where the ITL p99 comes from: the p99 of the gaps by their position in a stream (first: first "
            "token to second, in disaggregated mode the KV transfer and the decode worker's admission; last: "
            "the final gap; middle: the others), mean ± 95 % CI over the repetitions.", "", *lines, ""]


def _profile_table(w: dict) -> list[str]:
    """Per mode and rate with profiled runs, the mean over them of :mod:`_disagg_profile`'s keys."""
    lines = ["| mode | rate (req/s) | profiled runs | " + " | ".join(t for _, t, _ in COLUMNS) + " |",
             "|" + "---|" * (3 + len(COLUMNS))]
    for mode, m in w["modes"].items():
        for p in m["points"]:
            runs = [r for r in p["runs"] if r.get("profile")]
            if runs:
                prof = mean_profile(runs)
                cells = " | ".join("–" if prof[k] is None else f.format(prof[k]) for k, _, f in COLUMNS)
                lines.append(f"| {mode} | {p['rate']:g} | {len(runs)} | {cells} |")
    if len(lines) == 2:
        return []
    return ["Where the time goes: the cluster's own histograms (router and workers' `/metrics`) read "
            "before and after each run, mean over the profiled runs (`bench/_disagg_profile.py` defines "
            "each column; busy = summed step wall time / run wall time).", "", *lines, ""]


def _scale_table(w: dict, cfg: dict) -> list[str]:
    """Per SLO scale, each mode's DistServe goodput with every objective of the SLO times the scale."""
    modes = [m for m in w["modes"] if w["modes"][m].get("goodput_by_slo_scale")]
    if not modes or not cfg.get("slo_scales"):
        return []
    lines = ["| SLO scale | SLO | " + " | ".join(f"{m} goodput" for m in modes) + " |", "|" + "---|" * (2 + len(modes))]
    slo = parse_slo(cfg["slo"])
    for sc in cfg["slo_scales"]:
        scaled = ", ".join(f"{k.removesuffix('_ms')}={v:g}ms" for k, v in slo.scaled(sc).as_ms().items())
        cells = []
        for m in modes:
            g = w["modes"][m]["goodput_by_slo_scale"].get(f"{sc:g}", {})
            cells.append(("≥ " if g.get("at_highest") else "") + _rate(g.get("goodput")))
        lines.append(f"| {sc:g} | {scaled} | " + " | ".join(cells) + " |")
    return [f"DistServe goodput with every objective of the SLO ({cfg['slo']}) times a scale (DistServe's SLO-scale "
            "axis), recomputed from the recorded requests of the same runs; ≥: the highest rate measured (the "
            "sweep stopped there at scale 1). The targets are judged at scale 1.", "", *lines, ""]


def _targets(t: dict) -> list[str]:
    itl, gp = t["itl"], t["goodput"]
    ratio = "–" if itl["ratio"] is None else f"{itl['ratio']:.2f}"
    fmt = lambda v: "–" if v is None else f"{v:.0f} ms"  # noqa: E731
    lines = ["| target | disaggregated | colocated | ratio | result |", "|---|---|---|---|---|",
             f"| p99 ITL at {_rate(itl['rate'])} ≤ {itl['limit']:g} × colocated | {fmt(itl['disagg_itl_p99_ms'])}"
             f" | {fmt(itl['colocated_itl_p99_ms'])} | {ratio} | {_met(itl['met'])} |",
             f"| DistServe goodput ≥ colocated | {_rate(gp['disagg'])} | {_rate(gp['colocated'])} | – "
             f"| {_met(gp['met'])} |", ""]
    if itl["met"] is False or gp["met"] is False:
        lines += ["A target is missed: the analysis (bench/results/README.md) says why, from the profile "
                  "table above.", ""]
    return lines


def markdown(result: dict) -> str:
    """The result as markdown (header, per workload the mode tables and targets table)."""
    cfg = result["config"]
    lines = ["# Disaggregated vs colocated (generated by bench/disagg_vs_colocated.py)", "",
             f"Machine: {result['machine']['cpus']} CPUs, {result['machine']['platform']}. Model {result['model']}; "
             f"`pdcluster up --local {' '.join(cfg['cluster_args'])}` plus the mode's arguments. "
             f"Started {result['started']}, finished {result['finished']}.", "",
             f"Per (workload, mode, rate): {cfg['repetitions']} repetitions of {cfg['num_requests']} requests "
             f"(trace rows {cfg['skip']}..{cfg['skip'] + cfg['num_requests']}, outputs clipped to "
             f"{cfg['max_output_tokens']} tokens with ignore_eos, arrivals rescaled to the rate); values are mean ± "
             f"95 % CI half-width (Student t over the recorded repetitions). SLO: {cfg['slo']}. Load gate: a run is "
             f"recorded only when the 1-minute load before it, minus the idle cluster's baseline, is ≤ "
             f"{cfg['max_load']:g} (waiting up to {cfg['load_wait_s']:.0f} s).", ""]
    for name, w in result["workloads"].items():
        lines += [f"## Workload: {name} (`{w['trace']}`, inputs clipped to {w['max_input_tokens']} tokens)", ""]
        for mode, m in w["modes"].items():
            lines += _mode_table(mode, m, result["modes"][mode], name, result)
        lines += [f"### ITL by position ({name})", ""] + _gap_table(w)
        if profile := _profile_table(w):
            lines += [f"### Profile ({name})", ""] + profile
        if scales := _scale_table(w, cfg):
            lines += [f"### SLO scale ({name})", ""] + scales
        lines += [f"### Targets ({name})", ""] + _targets(w["targets"])
    lines += ["Goodput columns: vLLM's per-run goodput = completed requests meeting every SLO / run duration. "
              "DistServe's goodput = the highest request rate whose SLO attainment stays above the target.", ""]
    return "\n".join(lines)


def write_plot(path: Path, result: dict) -> None:
    """Per workload (rows): goodput, SLO attainment, p99 ITL and p99 TTFT against the rate,
    one line per mode with 95 % CI error bars."""
    from matplotlib.figure import Figure

    names = list(result["workloads"])
    fig = Figure(figsize=(16, 3.6 * len(names)))
    axes = fig.subplots(len(names), len(LABELS), squeeze=False)
    for row, name in zip(axes, names):
        for mode, m in result["workloads"][name]["modes"].items():
            pts = [p for p in m["points"] if p["stats"]["goodput"]["mean"] is not None]
            for ax, (key, title, scale, _) in zip(row, LABELS):
                ys = [scale * p["stats"][key]["mean"] if p["stats"][key]["mean"] is not None else float("nan")
                      for p in pts]
                err = [scale * (p["stats"][key]["ci95_half"] or 0.0) for p in pts]
                ax.errorbar([p["rate"] for p in pts], ys, yerr=err, marker="o", capsize=3, label=mode)
                ax.set_title(f"{name}: {title}", fontsize=9)
        for ax in row:
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        row[1].axhline(100 * result["config"]["attainment_target"], color="gray", ls="--", lw=1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
