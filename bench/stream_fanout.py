"""Stream fan-out: what relaying one message per step to N gRPC streams costs a stepping thread.

The decode worker's shape, reduced to its two parts: a thread running decode-step-sized torch work
at one torch thread (many GIL-releasing ``F.linear`` calls on ``[N, 576]`` activations and
``[576, 576]`` weights, SmolLM2's hidden size) and, after every step, one ``DecodeEvent`` (the real
protobuf, one token) to each of ``--streams`` server-streaming RPCs read by a client in another
process. Variants, each in a fresh process:

- ``none``: the steps alone (no server): the floor.
- ``sync_queue``: gRPC's thread-pool server, each stream's handler waiting on a ``queue.Queue``
  (the decode worker's ``Reserve`` before 2026-12-03).
- ``sync_simplequeue``: the same with ``queue.SimpleQueue`` (waits in C: the decode worker now).
- ``aio``: a ``grpc.aio`` server, the stepping thread handing each step's events to its event loop
  in one ``call_soon_threadsafe`` (the "one wakeup per step" design ``cluster_overhead.md`` proposed).

``--rounds`` rounds alternate the variants (this machine's speed drifts by tens of percent within
minutes); each variant's cost is the ratio of the floor's median step time to its own in the same
round, and the table gives the medians of those ratios. Writes ``stream_fanout.json`` / ``.md``.

Usage (from the repository root)::

    python bench/stream_fanout.py               # 32 streams, 150 steps, 5 rounds
    python bench/stream_fanout.py --quick       # 8 streams, 30 steps, one round
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import cpu_name, load_avg_1m, logger, out_dir, write_results  # noqa: E402

log = logger("fanout")
VARIANTS = ("none", "sync_queue", "sync_simplequeue", "aio")
HIDDEN = 576


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=32, help="server streams (and rows of the step's activations)")
    p.add_argument("--steps", type=int, default=150, help="measured steps per run (after 10 unmeasured)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each running every variant once")
    p.add_argument("--quick", action="store_true", help="8 streams, 30 steps, one round, into a temporary folder")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.steps, args.rounds = 8, 30, 1
    return args


def run_variant(variant: str, args) -> dict:
    """One variant in a fresh process: its step times (ms, median and mean) and the load before it."""
    load = load_avg_1m()
    out = subprocess.run([sys.executable, __file__, "--child", variant, "--streams", str(args.streams),
                          "--steps", str(args.steps)], capture_output=True, text=True, timeout=600, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {"variant": variant, "load_avg_1m_before": load, **res}


def summarize(rounds: list[list[dict]]) -> dict:
    """Per variant: median step time (ms) and throughput relative to ``none`` (floor / variant,
    per round), medians over the rounds."""
    out = {}
    for v in VARIANTS:
        steps = [next(r for r in rnd if r["variant"] == v)["step_ms_median"] for rnd in rounds]
        floor = [next(r for r in rnd if r["variant"] == "none")["step_ms_median"] for rnd in rounds]
        ratios = [f / s for f, s in zip(floor, steps)]
        out[v] = {"step_ms_median": statistics.median(steps), "rate_vs_none": statistics.median(ratios),
                  "rate_vs_none_per_round": ratios}
    return out


def markdown(res: dict) -> str:
    s = res["summary"]
    lines = [
        "# Stream fan-out (`bench/stream_fanout.py`)", "",
        f"{res['cpu']}; one torch thread; a step of {res['linears_per_step']} `F.linear` calls on "
        f"[{res['streams']}, {HIDDEN}] x [{HIDDEN}, {HIDDEN}] float32, then one `DecodeEvent` to each of "
        f"{res['streams']} gRPC server streams (client in another process); {res['steps']} measured steps per "
        f"run, {len(res['rounds'])} round(s) alternating the variants.", "",
        "| variant | median step (ms) | step rate vs no streams (median of rounds) | per round |",
        "|---|---|---|---|",
    ]
    for v in VARIANTS:
        per = ", ".join(f"{x:.3f}" for x in s[v]["rate_vs_none_per_round"])
        lines.append(f"| `{v}` | {s[v]['step_ms_median']:.2f} | {s[v]['rate_vs_none']:.3f} | {per} |")
    loads = [r["load_avg_1m_before"] for rnd in res["rounds"] for r in rnd]
    lines += ["", f"1-minute load before the runs: {min(loads):.2f}-{max(loads):.2f}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client is not None:
        from _fanout_child import client_main
        return client_main(args.client, args.streams)
    if args.child is not None:
        from _fanout_child import child_main
        return child_main(args.child, args.streams, args.steps, __file__)
    log(f"{args.rounds} round(s), {args.streams} streams, {args.steps} steps, load {load_avg_1m():.2f}")
    rounds = []
    for r in range(args.rounds):
        rounds.append([run_variant(v, args) for v in VARIANTS])
        log(f"round {r + 1}: " + ", ".join(f"{x['variant']} {x['step_ms_median']:.1f} ms" for x in rounds[-1]))
    from _fanout_child import LINEARS_PER_STEP
    res = {"benchmark": "stream_fanout", "cpu": cpu_name(), "streams": args.streams, "steps": args.steps,
           "linears_per_step": LINEARS_PER_STEP, "quick": args.quick, "rounds": rounds,
           "summary": summarize(rounds)}
    stem, text = write_results(res, out_dir(args.out_dir, args.quick, "fanout-"), "stream_fanout", markdown)
    print(json.dumps({v: round(res["summary"][v]["rate_vs_none"], 4) for v in VARIANTS}))
    log(f"wrote {stem}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
