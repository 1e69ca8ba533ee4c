"""Soak under faults: a 2P+2D local cluster replays the Azure 2023 conversation trace for a
long time, first without faults, then with a random worker killed (``kill -9``) every
``--kill-every`` seconds and Redis killed once (:mod:`deploy.chaos`), as
``tests/test_chaos.py`` does in two minutes.

Reported per phase (``--results-dir``/soak.json and soak.md): requests sent / completed /
failed, requests migrated by the router (``pdcluster:request_migrations_total``), workers and
Redis killed, p50/p99 TTFT, p99 ITL and mean TPOT (ms), the machine's 1-minute load average
before the phase. The two phases run on the same cluster, one after the other, at the same
request rate, so their latencies compare directly.

Usage (from the repository root)::

    python bench/soak.py --minutes 30              # 15 min fault-free, then 15 min with faults
    python bench/soak.py --minutes 4 --rate 0.5    # a short run
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.ray_env import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before anything imports ray: the local cluster stays on loopback

from _common import load_avg_1m, logger, write_results  # noqa: E402

from deploy.chaos import ChaosConfig, ChaosMonkey  # noqa: E402
from loadtest.driver import run_loadtest  # noqa: E402
from loadtest.runner import RunConfig  # noqa: E402
from loadtest.workload import WorkloadConfig  # noqa: E402
from pdcluster.cli import build_parser  # noqa: E402

CLUSTER_ARGS = ["--prefill", "2", "--decode", "2", "--max-model-len", "1024", "--num-kv-blocks", "600",
                "--heartbeat-s", "0.5"]
METRICS = (("ttft_p50_ms", "ttft_ms", "p50"), ("ttft_p99_ms", "ttft_ms", "p99"), ("itl_p99_ms", "itl_ms", "p99"),
           ("tpot_mean_ms", "tpot_ms", "mean"))
log = logger("soak")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="total sending time, split evenly between phases")
    p.add_argument("--rate", type=float, default=0.4, help="mean request rate (req/s)")
    p.add_argument("--kill-every", type=float, default=10.0, help="seconds between worker kills (faulty phase)")
    p.add_argument("--redis-kill-at", type=float, default=60.0, help="seconds into the faulty phase Redis is killed")
    p.add_argument("--max-input-tokens", type=int, default=512)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0 or args.kill_every <= 3:
        p.error("--minutes and --rate must be > 0, --kill-every > 3")
    return args


def migrations(http_address: str) -> float:
    """The router's ``pdcluster:request_migrations_total``, summed over its labels."""
    text = urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^pdcluster:request_migrations_total\{[^}]*\} (\S+)$", text, re.M))


def run_phase(name: str, state: dict, args: argparse.Namespace, seconds: float, chaos: ChaosConfig | None) -> dict:
    """Replay the trace for ``seconds`` (with ``chaos`` if given); returns the phase's row."""
    n = int(args.rate * seconds * 1.5) + 10  # more than the duration lets through: sending stops at the bound
    workload = WorkloadConfig(source="azure-conv", num_requests=n, rate=args.rate, seed=args.seed,
                              max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens)
    run = RunConfig(address=state["router_address"], duration_s=seconds, drain_timeout_s=300.0)
    load, before = load_avg_1m(), migrations(state["router_http_address"])
    log(f"{name}: {seconds / 60:.1f} min at {args.rate} req/s (1-min load before: {load:.2f})")
    if chaos is None:
        s, events = run_loadtest(workload, run, plots=False, progress=False).summary, []
    else:
        with ChaosMonkey(state["redis_url"], state["cluster"], chaos) as monkey:
            s = run_loadtest(workload, run, plots=False, progress=False).summary
        events = monkey.events
    row = {"phase": name, "minutes": round(seconds / 60, 2), "load_avg_1m_before": load, "sent": s["sent"],
           "completed": s["completed"], "failed": s["failed"], "errors": s.get("errors", {}),
           "migrated": migrations(state["router_http_address"]) - before,
           "workers_killed": sum(e["kind"] == "kill_worker" for e in events),
           "redis_killed": sum(e["kind"] == "kill_redis" for e in events),
           **{k: s[key][stat] for k, key, stat in METRICS}, "chaos_events": events}
    log(f"{name}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k != "chaos_events"))
    return row


def markdown(res: dict) -> str:
    cols = ("phase", "minutes", "sent", "completed", "failed", "migrated", "workers_killed", "redis_killed",
            "ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "tpot_mean_ms", "load_avg_1m_before")
    lines = ["# Soak under faults (`bench/soak.py`)", "",
             f"2P+2D local cluster (`pdcluster up --local {' '.join(CLUSTER_ARGS)}`), Azure 2023 conversation "
             f"trace at {res['rate']} req/s (inputs clipped to {res['max_input_tokens']}, outputs to "
             f"{res['max_output_tokens']} tokens); faulty phase: a random worker `kill -9`-ed every "
             f"~{res['kill_every_s']} s, Redis once. Latencies in ms.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in res["phases"]:
        lines.append("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from deploy import local

    args = parse_args(argv)
    state_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    up = build_parser().parse_args(["up", "--local", "--port", "0", "--http-port", "0", "--state-dir",
                                    str(state_dir), *CLUSTER_ARGS])
    state = local.up(up)
    half = args.minutes * 60 / 2
    try:
        chaos = ChaosConfig(kill_every_s=args.kill_every, jitter_s=min(3.0, args.kill_every / 3),
                            redis_kill_at_s=args.redis_kill_at, seed=args.seed)
        phases = [run_phase("fault-free", state, args, half, None), run_phase("faults", state, args, half, chaos)]
    finally:
        local.down(state_dir)
    res = {"rate": args.rate, "kill_every_s": args.kill_every, "max_input_tokens": args.max_input_tokens,
           "max_output_tokens": args.max_output_tokens, "cluster_args": CLUSTER_ARGS, "phases": phases}
    stem, _ = write_results(res, args.results_dir, "soak", markdown)
    log(f"wrote {stem}.json and {stem}.md")
    print(markdown(res))
    return 0 if all(p["failed"] == 0 for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
