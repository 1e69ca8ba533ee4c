"""Pictures of a running cluster for the README: ``pdcluster top`` and dashboard panels from real data.

Brings up a local 1P+2D cluster, starts Prometheus on it (``deploy/prometheus``), replays a
short synthetic load through ``pdcluster loadtest``, then writes into ``--out``:

* ``top.svg``: one refresh of ``pdcluster top`` (rich's own SVG export);
* ``dashboard.png``: six panels of ``deploy/grafana/pdcluster.json`` drawn with matplotlib from
  the same PromQL run against Prometheus (``query_range`` over the load).

Usage: ``python scripts/dashboard_snapshot.py --out docs/img`` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deploy.ray_env import use_loopback_ray  # noqa: E402

use_loopback_ray()

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402

from deploy import local  # noqa: E402
from deploy.prometheus_server import PrometheusServer  # noqa: E402
from pdcluster.cli import build_parser  # noqa: E402
from pdcluster.cli import main as cli_main  # noqa: E402
from pdcluster.top import render, snapshot  # noqa: E402

PANELS = ("TTFT p50 / p99", "ITL p50 / p99", "Prefill time vs prompt length", "Decode step time vs batch size",
          "KV cache usage per worker", "Requests waiting and running")


def draw(prom: PrometheusServer, start: float, end: float, out: Path) -> None:
    """Draw :data:`PANELS` of the Grafana dashboard from Prometheus range queries."""
    panels = {p["title"]: p for p in json.loads((REPO / "deploy/grafana/pdcluster.json").read_text())["panels"]}
    fig, axes = plt.subplots(3, 2, figsize=(13, 10))
    for ax, title in zip(axes.flat, PANELS):
        targets = panels[title]["targets"]
        twin = ax.twinx() if " vs " in title else None  # the two series have different units
        for i, target in enumerate(targets):
            axis = twin if twin is not None and i else ax
            expr = target["expr"].replace("$__rate_interval", "30s")
            for series in prom.query_range(expr, start, end, 2.0):
                label = target["legendFormat"]
                for key, value in series["metric"].items():
                    label = label.replace("{{" + key + "}}", value)
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                axis.plot(xs, ys, label=label, color=f"C{i + 2}" if axis is twin else None)
        steps = panels[title].get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
        for step in steps:  # the panel's threshold lines, as Grafana draws them
            if step.get("value") is not None:
                ax.axhline(step["value"], color=step["color"], linestyle="--", label=f"threshold {step['value']}")
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.legend(fontsize=7, loc="upper left")
        if twin is not None:
            twin.legend(fontsize=7, loc="upper right")
        ax.grid(alpha=0.3)
    fig.suptitle("pdcluster dashboard panels (deploy/grafana/pdcluster.json), from Prometheus, 1P+2D on 2 CPU cores")
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    p.add_argument("--num-requests", type=int, default=40)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="pdcluster-snapshot-"))
    up = build_parser().parse_args(["up", "--local", "--port", "0", "--http-port", "0", "--decode", "2",
                                    "--max-model-len", "1024", "--num-kv-blocks", "400", "--state-dir", str(tmp / "s")])
    state = local.up(up)
    try:
        prom = PrometheusServer(state["router_http_address"], tmp / "prometheus").start()
        start = time.time()
        load = threading.Thread(target=cli_main, args=([
            "loadtest", "--address", state["router_address"], "--workload", "synthetic", "--rate", "0.8",
            "--num-requests", str(args.num_requests), "--input-len", "256", "--len-range", "0.8", "--output-len", "32",
            "--output-dir", str(tmp / "lt"), "--no-plots", "--no-progress"],))
        load.start()
        time.sleep(args.num_requests / 3)  # mid-load
        base = f"http://{state['router_http_address']}"
        before = {s.worker_id: s for s in snapshot(base)}
        time.sleep(5.0)
        console = Console(record=True, width=150, force_terminal=True)
        console.print(render(snapshot(base), before))  # what one refresh of `pdcluster top` shows
        console.save_svg(str(args.out / "top.svg"), title="pdcluster top")
        load.join()
        time.sleep(4)
        draw(prom, start, time.time(), args.out / "dashboard.png")
        prom.stop()
    finally:
        local.down(tmp / "s")
    print(f"wrote {args.out / 'top.svg'} and {args.out / 'dashboard.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
