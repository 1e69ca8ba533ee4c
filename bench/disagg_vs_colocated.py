"""Disaggregated vs colocated serving on one machine, at a sweep of request rates.

Each mode is brought up with ``pdcluster up --local`` (through the CLI's own parser, as
``tests/cluster_utils.py`` does) with the same model, KV pool and number of workers, so
both get the same CPU threads (each worker's torch threads are its share of the cores).
The same Azure-conversation trace slice (lengths clipped so the CPU keeps up) is replayed
at every rate with ``--rate`` (the slice's burst pattern rescaled to that mean rate), and
the comparison is written to ``--results-dir``:

* ``disagg_vs_colocated.json`` / ``.md``: per mode and rate, p50/p99 TTFT, p99 ITL, mean
  and p99 TPOT, SLO attainment and goodput (vLLM's per-run goodput: req/s of completed
  requests meeting every SLO); per mode, DistServe's goodput: the highest swept rate
  whose SLO attainment stays >= ``--attainment-target``;
* ``disagg_vs_colocated.png``: the same against the rate;
* ``runs/<mode>/rate_<r>/``: each run's summary.json, requests.jsonl and report.md.

A mode whose extra arguments ``pdcluster up`` rejects (e.g. a build without ``--colocated``)
is skipped, and the result says so. Every run is bounded (``--run-duration`` seconds of
sending, then at most ``--drain-timeout`` seconds) and only targets the local router.

Usage (from the repository root)::

    python bench/disagg_vs_colocated.py --modes disaggregated,colocated --rates 0.2,0.4,0.8 --num-requests 20
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.ray_env import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before anything imports ray: the local clusters stay on loopback

from loadtest.driver import run_loadtest  # noqa: E402
from loadtest.metrics import max_rate_meeting, parse_slo  # noqa: E402
from loadtest.runner import RunConfig  # noqa: E402
from loadtest.workload import WorkloadConfig  # noqa: E402
from pdcluster.cli import build_parser  # noqa: E402

DISAGG_ARGS = ["--prefill", "1", "--decode", "1"]
"""Extra ``pdcluster up`` arguments of the disaggregated mode (2 workers)."""

COLOCATED_ARGS = ["--colocated", "--workers", "2"]
"""Extra ``pdcluster up`` arguments of the colocated mode (2 workers, prefill + decode on each)."""

MODES = {"disaggregated": DISAGG_ARGS, "colocated": COLOCATED_ARGS}

CLUSTER_ARGS = ["--max-model-len", "512", "--block-size", "16", "--num-kv-blocks", "800", "--heartbeat-s", "0.5"]
"""``pdcluster up`` arguments shared by both modes."""

METRICS = (("ttft_p50_ms", "ttft_ms", "p50"), ("ttft_p99_ms", "ttft_ms", "p99"), ("itl_p99_ms", "itl_ms", "p99"),
           ("tpot_mean_ms", "tpot_ms", "mean"), ("tpot_p99_ms", "tpot_ms", "p99"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="disaggregated,colocated", help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--rates", default="0.2,0.4,0.8", help="request rates to sweep (req/s, >= 3 values)")
    p.add_argument("--num-requests", type=int, default=20, help="requests per rate (the same trace rows)")
    p.add_argument("--skip", type=int, default=0, help="trace rows skipped before the slice")
    p.add_argument("--max-input-tokens", type=int, default=128)
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--slo", default="ttft=2s,tpot=200ms", help="SLOs of attainment and goodput")
    p.add_argument("--attainment-target", type=float, default=0.9, help="DistServe goodput target")
    p.add_argument("--run-duration", type=float, default=180.0, help="seconds of sending per run, at most")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to finish a run after sending")
    p.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.rates = sorted(float(r) for r in args.rates.split(","))
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if len(args.rates) < 3:
        p.error("give at least 3 rates")
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}")
    return args


def up_args(mode_args: list[str], state_dir: Path) -> tuple[argparse.Namespace | None, str]:
    """Parse ``pdcluster up`` arguments of a mode; ``(None, reason)`` when the parser rejects them."""
    argv = ["up", "--local", "--port", "0", "--state-dir", str(state_dir), *CLUSTER_ARGS, *mode_args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv), ""
    except SystemExit:
        return None, f"`pdcluster {' '.join(argv[:2])} ... {' '.join(mode_args)}` rejected: " + \
            err.getvalue().strip().splitlines()[-1]


def run_mode(mode: str, args: argparse.Namespace, slo) -> dict:
    """Bring the mode's cluster up, replay the slice at every rate, bring it down."""
    from deploy import local

    state_dir = Path(tempfile.mkdtemp(prefix=f"bench-{mode}-"))
    up, reason = up_args(MODES[mode], state_dir)
    if up is None:
        print(f"[{mode}] skipped: {reason}", flush=True)
        return {"mode": mode, "up_args": MODES[mode], "skipped": reason, "runs": []}
    runs, model = [], None
    try:
        state = local.up(up)
    except Exception as exc:  # noqa: BLE001 - reported in the result, the other mode still runs
        local.down(state_dir)
        return {"mode": mode, "up_args": MODES[mode], "skipped": f"`up` failed: {exc!r}", "runs": []}
    try:
        for rate in args.rates:
            out = args.results_dir / "runs" / mode / f"rate_{rate:g}"
            workload = WorkloadConfig(source="azure-conv", num_requests=args.num_requests, skip=args.skip,
                                      rate=rate, max_input_tokens=args.max_input_tokens,
                                      max_output_tokens=args.max_output_tokens, seed=args.seed)
            run = RunConfig(address=state["router_address"], duration_s=args.run_duration,
                            drain_timeout_s=args.drain_timeout)
            load = os.getloadavg()[0]
            print(f"[{mode}] rate {rate:g} req/s, {args.num_requests} requests (1-min load before: {load:.2f})",
                  flush=True)
            s = run_loadtest(workload, run, slo=slo, output_dir=out, plots=False, progress=False).summary
            model = s["model"]
            row = {"rate": rate, "load_avg_1m_before": load, "sent": s["sent"], "completed": s["completed"],
                   "failed": s["failed"], "duration_s": s["duration_s"],
                   "request_throughput": s["request_throughput"], "output_throughput": s["output_throughput"],
                   "slo_attainment": s["slo_attainment"], "goodput": s["goodput"],
                   **{name: s[key][stat] for name, key, stat in METRICS}}
            print(f"[{mode}]   " + ", ".join(f"{k}={v:.3g}" for k, v in row.items() if isinstance(v, float)),
                  flush=True)
            runs.append(row)
    finally:
        local.down(state_dir)
    max_rate = max_rate_meeting([r["rate"] for r in runs], [r["slo_attainment"] for r in runs],
                                args.attainment_target)
    return {"mode": mode, "up_args": MODES[mode], "model": model, "runs": runs, "distserve_goodput": max_rate}


def _fmt(v) -> str:
    if v is None:
        return "–"
    return f"{v:.0f}" if isinstance(v, float) else str(v)


def write_markdown(path: Path, result: dict) -> None:
    cfg = result["config"]
    lines = ["# Disaggregated vs colocated (generated by bench/disagg_vs_colocated.py)", "",
             f"Machine: {result['machine']['cpus']} CPUs, {result['machine']['platform']}. "
             f"Model {result['model']}; `pdcluster up --local {' '.join(CLUSTER_ARGS)}` plus the mode's arguments.",
             f"Workload: Azure LLM inference trace 2023 (conversation), rows {cfg['skip']}..{cfg['skip'] + cfg['num_requests']}, "
             f"inputs clipped to {cfg['max_input_tokens']} tokens, outputs to {cfg['max_output_tokens']} "
             f"(ignore_eos), arrivals rescaled to each rate. SLO: {cfg['slo']}.", ""]
    for m in result["modes"]:
        lines.append(f"## {m['mode']} (`{' '.join(m['up_args'])}`)")
        lines.append("")
        if m.get("skipped"):
            lines += [f"**Not run:** {m['skipped']}", ""]
            continue
        lines += ["| rate (req/s) | done/sent | TTFT p50 (ms) | TTFT p99 (ms) | ITL p99 (ms) | TPOT mean (ms) | "
                  "TPOT p99 (ms) | SLO attainment | goodput (req/s) | throughput (req/s) | load avg before |",
                  "|" + "---|" * 11]
        for r in m["runs"]:
            lines.append(f"| {r['rate']:g} | {r['completed']}/{r['sent']} | {_fmt(r['ttft_p50_ms'])} | "
                         f"{_fmt(r['ttft_p99_ms'])} | {_fmt(r['itl_p99_ms'])} | {_fmt(r['tpot_mean_ms'])} | "
                         f"{_fmt(r['tpot_p99_ms'])} | {100 * r['slo_attainment']:.0f} % | {r['goodput']:.3f} | "
                         f"{r['request_throughput']:.3f} | {r['load_avg_1m_before']:.2f} |")
        best = m["distserve_goodput"]
        lines += ["", f"DistServe goodput (highest swept rate with SLO attainment ≥ "
                      f"{100 * cfg['attainment_target']:.0f} %): "
                      + (f"**{best:g} req/s**" if best is not None else "**none of the swept rates**"), ""]
    lines += ["Goodput columns: vLLM's per-run goodput = completed requests meeting every SLO / run duration. "
              "DistServe's goodput = the highest request rate whose SLO attainment stays above the target.", ""]
    path.write_text("\n".join(lines))


def write_plot(path: Path, result: dict) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4))
    axes = fig.subplots(1, 3)
    for m in result["modes"]:
        if not m["runs"]:
            continue
        rates = [r["rate"] for r in m["runs"]]
        for key, ls in (("ttft_p50_ms", ":"), ("ttft_p99_ms", "-")):
            axes[0].plot(rates, [r[key] for r in m["runs"]], ls, marker="o", label=f"{m['mode']} {key[:8]}")
        for key, ls in (("tpot_mean_ms", ":"), ("itl_p99_ms", "-")):
            axes[1].plot(rates, [r[key] for r in m["runs"]], ls, marker="o", label=f"{m['mode']} {key[:-3]}")
        axes[2].plot(rates, [100 * r["slo_attainment"] for r in m["runs"]], marker="o", label=m["mode"])
    axes[2].set_ylim(-5, 105)
    axes[2].axhline(100 * result["config"]["attainment_target"], color="gray", ls="--", lw=1, label="target")
    for ax, title, unit in zip(axes, ("TTFT", "TPOT and ITL", f"SLO attainment ({result['config']['slo']})"),
                               ("ms", "ms", "%")):
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    slo = parse_slo(args.slo)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    modes = [run_mode(mode, args, slo) if mode in args.modes else
             {"mode": mode, "up_args": MODES[mode], "skipped": "not selected in this invocation (--modes)", "runs": []}
             for mode in MODES]
    result = {
        "started": started, "model": next((m["model"] for m in modes if m.get("model")), None),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": {"rates": args.rates, "num_requests": args.num_requests, "skip": args.skip,
                   "max_input_tokens": args.max_input_tokens, "max_output_tokens": args.max_output_tokens,
                   "slo": args.slo, "attainment_target": args.attainment_target, "cluster_args": CLUSTER_ARGS},
        "modes": modes,
    }
    base = args.results_dir / "disagg_vs_colocated"
    base.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(base.with_suffix(".md"), result)
    write_plot(base.with_suffix(".png"), result)
    print(f"wrote {base}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
