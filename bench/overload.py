"""Overload: how fast a local cluster's router refuses the excess of a burst (issue #12).

A 1 prefill + 2 decode cluster with ``--max-num-seqs 4 --max-queued-requests 64`` (the router
holds 2 x 4 + 64 = 72 requests) gets ``--requests`` (500) streamed requests at once, sent from
one thread on one channel by a separate slim client process (``bench/_burst_client.py``). Each
call's latency is send to status, at the client. Reported per repetition: the refusals' p50,
p99 and max, the accepted ones' p50, and how many of each.

The peer, in the same run with the same client: a bare gRPC Python server
(``bench/_burst_peer.py``) that admits 72 calls and refuses the rest in its handler, without
any of the router's work: gRPC Python's own cost for that burst on this machine, the floor.
Repetitions alternate router and peer; the 1-minute load average is noted before each.

Usage (from the repository root)::

    python bench/overload.py              # 5 repetitions of each
    python bench/overload.py --reps 2     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from deploy.ray_env import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before anything imports ray: the local cluster stays on loopback

from _common import cpu_name, load_avg_1m, logger, write_results  # noqa: E402

log = logger("overload")
SEQS, QUEUED, DECODES = 4, 64, 2
CAPACITY = DECODES * SEQS + QUEUED
SETTLE_S = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=500, help="requests in each burst")
    p.add_argument("--reps", type=int, default=5, help="bursts against each target")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--name", default="overload")
    args = p.parse_args(argv)
    if args.requests <= CAPACITY or args.reps < 1:
        p.error(f"--requests must exceed the capacity ({CAPACITY}) and --reps be >= 1")
    return args


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def one_burst(address: str, n: int) -> dict:
    """One burst from a fresh client process; latencies in ms."""
    load = load_avg_1m()
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "_burst_client.py"), address, str(n)],
                         capture_output=True, text=True, timeout=600, check=True)
    calls = json.loads(out.stdout)
    refused = [1e3 * t for code, t in calls if code == "RESOURCE_EXHAUSTED"]
    ok = [1e3 * t for code, t in calls if code == "OK"]
    other = sorted({code for code, _ in calls} - {"OK", "RESOURCE_EXHAUSTED"})
    return {"load_avg_1m_before": load, "refused": len(refused), "accepted": len(ok), "other_codes": other,
            "refusal_ms_p50": _pct(refused, 0.5), "refusal_ms_p99": _pct(refused, 0.99),
            "refusal_ms_max": max(refused), "accepted_ms_p50": _pct(ok, 0.5) if ok else None}


def summary(runs: list[dict]) -> dict:
    keys = ("refusal_ms_p50", "refusal_ms_p99", "refusal_ms_max")
    return {f"{k}_median": statistics.median(r[k] for r in runs) for k in keys} | \
        {"refusal_ms_max_worst": max(r["refusal_ms_max"] for r in runs),
         "within_100ms": sum(r["refusal_ms_max"] <= 100 for r in runs)}


def markdown(res: dict) -> str:
    rows = ["| target | rep | load 1m | accepted | refused | refusal p50 ms | p99 ms | max ms | accepted p50 ms |",
            "|---|---|---|---|---|---|---|---|---|"]
    for target in ("router", "peer"):
        for i, r in enumerate(res[target]["runs"]):
            rows.append(f"| {target} | {i + 1} | {r['load_avg_1m_before']:.2f} | {r['accepted']} | {r['refused']} | "
                        f"{r['refusal_ms_p50']:.0f} | {r['refusal_ms_p99']:.0f} | {r['refusal_ms_max']:.0f} | "
                        f"{r['accepted_ms_p50'] or 0:.0f} |")
    s, p = res["router"]["summary"], res["peer"]["summary"]
    return "\n".join([
        f"# Overload: {res['requests']} requests at once, room for {res['capacity']}", "",
        f"CPU: {res['cpu']}; {res['reps']} bursts per target, alternating; client: one thread, one channel, "
        "a fresh process per burst; latency = send to status at the client.", "",
        *rows, "",
        "| target | refusal p50 ms (median) | p99 ms (median) | max ms (median) | max ms (worst) | bursts with max <= 100 ms |",
        "|---|---|---|---|---|---|",
        *(f"| {t} | {x['refusal_ms_p50_median']:.0f} | {x['refusal_ms_p99_median']:.0f} | {x['refusal_ms_max_median']:.0f} "
          f"| {x['refusal_ms_max_worst']:.0f} | {x['within_100ms']} of {res['reps']} |" for t, x in (("router", s), ("peer", p))),
        "", f"Router / peer, median of the max refusal latency: **{res['ratio_max_to_peer']:.2f}x**.", ""])


def main(argv: list[str] | None = None) -> int:
    from deploy import local
    from pdcluster.cli import build_parser
    from pdcluster.client import PdclusterClient

    args = parse_args(argv)
    state_dir = Path(tempfile.mkdtemp(prefix="overload-"))
    up = build_parser().parse_args([
        "up", "--local", "--port", "0", "--http-port", "0", "--state-dir", str(state_dir), "--prefill", "1",
        "--decode", str(DECODES), "--max-num-seqs", str(SEQS), "--max-queued-requests", str(QUEUED),
        "--router-policy", "round_robin", "--max-model-len", "512", "--num-kv-blocks", "300"])
    peer = subprocess.Popen([sys.executable, str(ROOT / "bench" / "_burst_peer.py"), str(CAPACITY)],
                            stdout=subprocess.PIPE, text=True)
    runs: dict[str, list[dict]] = {"router": [], "peer": []}
    try:
        peer_address = f"127.0.0.1:{peer.stdout.readline().strip()}"
        state = local.up(up)
        with PdclusterClient(state["router_address"], timeout_s=600) as client:
            client.wait_ready(120)
            client.generate("Hello", max_tokens=4)  # warm-up
        targets = {"router": state["router_address"], "peer": peer_address}
        for rep in range(args.reps):
            for target, address in targets.items():
                time.sleep(SETTLE_S)
                r = one_burst(address, args.requests)
                runs[target].append(r)
                log(f"{target} burst {rep + 1}: refusals p50 {r['refusal_ms_p50']:.0f} ms, max "
                    f"{r['refusal_ms_max']:.0f} ms ({r['refused']} refused, {r['accepted']} accepted, "
                    f"load {r['load_avg_1m_before']:.2f})")
    finally:
        peer.kill()
        local.down(state_dir)
    res = {"benchmark": "overload", "cpu": cpu_name(), "requests": args.requests, "capacity": CAPACITY,
           "reps": args.reps, "router": {"runs": runs["router"], "summary": summary(runs["router"])},
           "peer": {"runs": runs["peer"], "summary": summary(runs["peer"])}}
    res["ratio_max_to_peer"] = res["router"]["summary"]["refusal_ms_max_median"] / \
        res["peer"]["summary"]["refusal_ms_max_median"]
    stem, _ = write_results(res, args.out_dir, args.name, markdown)
    print(stem.with_suffix(".md").read_text())  # the tables; the JSON has the same figures
    log(f"wrote {stem}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
