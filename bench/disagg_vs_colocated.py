"""Disaggregated vs colocated serving on one machine: repeated runs at a sweep of request rates,
on two Azure workloads, with confidence intervals.

Each mode is brought up with ``pdcluster up --local`` (through the CLI's own parser, as
``tests/cluster_utils.py`` does) with the same model, KV pool and number of workers, once per
workload: the disaggregated mode's per-phase threads and prefill token budget are chosen per
workload, as DistServe chooses each phase's parallelism (``_disagg_cluster.MODES``, with the
measurements behind them). Colocated runs first. Per mode and workload:

1. **Warm-up**: once the cluster is up, ``--warmup-requests`` requests of the workload
   are replayed at the lowest rate and thrown away (model pages, allocator, gRPC channels).
2. **Idle baseline**: the idle cluster's own CPU use (cores, over ``--baseline-window-s``):
   every process of the Ray head's session, its Redis and this driver, from ``/proc``.
3. **Sweep** of the workload (``--workloads``: ``conversation`` = the repository's Azure LLM
   inference trace 2023 conversation CSV, ``code`` = its code CSV, whose long prompts make
   prefill interfere with decode; both from ``loadtest/data/azure2023``, nothing outside the
   repository is read), per rate (ascending), ``--repetitions`` runs of the same
   ``--num-requests`` trace rows with the burst pattern rescaled to that rate (repetition
   ``i`` uses seed ``--seed + i`` for the prompt tokens). With ``--stop-below-attainment``,
   colocated stops raising the rate after the first rate whose mean SLO attainment is below
   it; disaggregated then runs exactly the rates colocated ran.

**Load gate.** Before every measured run (our cluster up but idle: the previous run has
drained) the 1-minute load average is read; the gate value is that load minus the idle
baseline of step 2, i.e. an estimate of the load with nothing of ours running. If it exceeds
``--max-load`` (default 1.0), the bench waits up to ``--load-wait-s`` for it to drop
(polling every ``--load-poll-s``); if it does not, the run is not recorded (it appears under
``skipped_runs`` with the load seen). Why subtract the baseline: the cluster being up is
itself load (0.5 s heartbeats, health checks, Ray's GCS/raylet loops); a process using ``x``
cores on average adds about ``x`` to the load average of an otherwise idle machine, and
without subtracting it an idle cluster that alone sits near the limit would make every point
wait or be refused. The baseline is measured as CPU use (not load) so that it stays
meaningful on a loaded machine, where our runnable-but-waiting tasks would inflate a load
reading. Measured on the 2-core dev machine (10 s windows, 2026-12-01): an idle colocated
cluster uses 0.06-0.09 cores and an idle disaggregated one 0.09, so the idle cluster alone
does not keep the 1-minute load above 1.0; subtracting it only stops it from eating into the
limit. ``--idle-baseline X`` gives it instead (0 = the raw load gate). After a run the
1-minute average decays with a 60 s time constant, so expect about a minute of waiting
between runs. The bench never kills or waits for anything but its own runs.

**Outputs** in ``--results-dir``:

* ``disagg_vs_colocated.json``: config, machine, per mode its arguments, warm-up and idle baseline per workload; per
  workload and mode the points (rate, every recorded run with the load before it, skipped
  runs, and mean / 95 % CI (Student t over repetitions) of goodput, SLO attainment, p99 ITL
  and p99 TTFT), DistServe goodput (highest rate whose mean attainment >= the target, every
  lower rate too), and the targets (disaggregated p99 ITL <= 0.5 x colocated's at the rate
  where colocated first drops below the attainment target, else its highest rate;
  disaggregated DistServe goodput >= colocated's) with met / missed;
  Each run also records ``cluster_cpu_cores``: the cluster's CPU use over the run (cores, out of
  ``os.cpu_count()``), a first clue when a target is missed (CPU-bound or not), and ``profile``:
  where its time went, from the cluster's own histograms read before and after it
  (:mod:`_disagg_profile`: TTFT, prefill queue and step times, prefill tokens/s, busy fractions,
  decode step and batch, KV transfer);
* ``disagg_vs_colocated.md`` / ``.png``: the same as tables and plots (error bars: 95 % CI), with
  a profile table per workload (mean of the runs' profiles);
* ``runs/<workload>/<mode>/rate_<r>/rep_<i>/``: each run's summary.json, requests.jsonl, report.md,
  and row.json (the recorded row with the settings it ran with).

**Resuming.** The full sweep takes about 5 hours alone on the 2-core machine. ``--resume`` keeps
every run already recorded under ``--results-dir`` with the same settings (``row.json``; a run
whose settings differ in any way, e.g. another ``--num-requests`` or cluster layout, runs again)
and runs only the rest, so the sweep can be spread over several quiet sessions; each kept run
carries ``"resumed": true`` and its own load-gate reading. Stop a session between runs with
SIGTERM (a run in progress does not answer Ctrl-C), bring its cluster down with ``pdcluster down
--state-dir /tmp/bench-<mode>-*``, and start the same command with ``--resume`` in the next one.
``--report-only`` builds the outputs from the recorded runs alone (no cluster is brought up):
the way to write the final result once the last session recorded the last run. A rate with no
recorded run of a workload is left out of that workload (the rates are shared by the workloads).

Usage (from the repository root; the full default sweep takes hours on 2 cores)::

    python bench/disagg_vs_colocated.py --rates 0.2,0.4,0.6,0.8,1.0 --stop-below-attainment 0.9
    python bench/disagg_vs_colocated.py --rates 0.2,0.4,0.6,0.8,1.0 --stop-below-attainment 0.9 --resume
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from deploy.ray_env import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before anything imports ray: the local clusters stay on loopback

import _disagg_cluster as dc  # noqa: E402
import _disagg_profile as dp  # noqa: E402
import _disagg_report  # noqa: E402
import _disagg_stats as ds  # noqa: E402
from _common import logger, write_results  # noqa: E402

from loadtest.metrics import parse_slo  # noqa: E402
from loadtest.records import RequestRecord  # noqa: E402
from loadtest.workload import WorkloadConfig  # noqa: E402

WORKLOADS = {"conversation": ("azure-conv", 128), "code": ("azure-code", 384)}
"""Workload -> (trace of ``loadtest/traces.py``, default input clip in tokens; 384 + 16
outputs fits ``--max-model-len 512`` and keeps the code prompts' long prefills)."""

log = logger("disagg")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="colocated,disaggregated", help="comma-separated subset of " + ",".join(dc.MODES))
    p.add_argument("--workloads", default="conversation,code", help="comma-separated subset of " + ",".join(WORKLOADS))
    p.add_argument("--rates", default="0.2,0.4,0.6,0.8,1.0", help="request rates to sweep (req/s)")
    p.add_argument("--repetitions", type=int, default=3, help="measured runs per (workload, mode, rate)")
    p.add_argument("--num-requests", type=int, default=100, help="requests per run (the same trace rows)")
    p.add_argument("--stop-below-attainment", type=float, default=None,
                   help="stop raising the rate once colocated's mean attainment at a rate is below this")
    p.add_argument("--skip", type=int, default=0, help="trace rows skipped before the slice")
    p.add_argument("--max-input-tokens", default="conversation=128,code=384", help="input clip per workload")
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--slo", default="ttft=2s,tpot=200ms", help="SLOs of attainment and goodput")
    p.add_argument("--slo-scales", default="0.25,0.5,1,2",
                   help="also report attainment and DistServe goodput with every --slo objective times each of these")
    p.add_argument("--attainment-target", type=float, default=0.9, help="DistServe goodput target")
    p.add_argument("--warmup-requests", type=int, default=10, help="unrecorded requests after each mode's up")
    p.add_argument("--max-load", type=float, default=1.0, help="load gate (1-min load minus the idle baseline)")
    p.add_argument("--load-wait-s", type=float, default=600.0, help="seconds to wait for the load gate")
    p.add_argument("--load-poll-s", type=float, default=10.0, help="seconds between load readings")
    p.add_argument("--idle-baseline", type=float, default=None, help="idle cluster load (cores); default: measured")
    p.add_argument("--baseline-window-s", type=float, default=30.0, help="seconds the idle baseline is measured")
    p.add_argument("--run-duration", type=float, default=1200.0, help="seconds of sending per run, at most")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to finish a run after sending")
    p.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help="keep every run an earlier invocation recorded under --results-dir with the same settings "
                        "(its runs/.../row.json) instead of running it again: the sweep can span several sessions")
    p.add_argument("--report-only", action="store_true",
                   help="bring no cluster up and run nothing: build the JSON, markdown and plot from the runs recorded "
                        "under --results-dir with these settings (as --resume would keep them)")
    args = p.parse_args(argv)
    return _check(p, args)


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    try:
        args.rates = sorted(float(r) for r in _split(args.rates))
        clips = {k.strip(): int(v) for k, v in (kv.split("=") for kv in _split(args.max_input_tokens))}
        args.slo_obj = parse_slo(args.slo)
        args.slo_scales = sorted(float(x) for x in _split(args.slo_scales))
    except ValueError as exc:
        p.error(f"bad --rates, --max-input-tokens or --slo: {exc}")
    args.modes, args.workloads = _split(args.modes), _split(args.workloads)
    if unknown := set(args.modes) - set(dc.MODES):
        p.error(f"unknown modes {sorted(unknown)}")
    if unknown := (set(args.workloads) | set(clips)) - set(WORKLOADS):
        p.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    args.clips = {w: clips.get(w, WORKLOADS[w][1]) for w in WORKLOADS}
    if not args.rates or min(args.rates) <= 0 or not args.workloads or not args.modes:
        p.error("give at least one rate (> 0 req/s), one workload and one mode")
    if args.repetitions < 1 or args.num_requests < 1 or args.warmup_requests < 0:
        p.error("--repetitions and --num-requests must be >= 1, --warmup-requests >= 0")
    if args.max_load < 0 or args.load_wait_s < 0 or args.load_poll_s <= 0 or args.baseline_window_s <= 0:
        p.error("--max-load, --load-wait-s must be >= 0; --load-poll-s, --baseline-window-s > 0")
    if args.num_requests / min(args.rates) > args.run_duration:
        p.error(f"--num-requests {args.num_requests} at {min(args.rates):g} req/s need about "
                f"{args.num_requests / min(args.rates):.0f} s of sending > --run-duration {args.run_duration:g}")
    if not args.slo_scales or min(args.slo_scales) <= 0:
        p.error("--slo-scales: give at least one scale, each > 0")
    if not 0 < args.attainment_target <= 1:
        p.error("--attainment-target must be in (0, 1]")
    return args


def workload_config(args, workload: str, rate: float, num_requests: int, seed: int) -> WorkloadConfig:
    """The replay of ``workload``'s trace slice at ``rate`` req/s (lengths clipped)."""
    return WorkloadConfig(source=WORKLOADS[workload][0], num_requests=num_requests, skip=args.skip, rate=rate,
                          max_input_tokens=args.clips[workload], max_output_tokens=args.max_output_tokens, seed=seed)


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.0f} ms"


def run_settings(args, workload: str, mode: str, rate: float, rep: int) -> dict:
    """Everything a recorded run depends on: ``--resume`` keeps a run only if these are equal."""
    return {"workload": workload, "mode": mode, "rate": rate, "rep": rep, "seed": args.seed + rep,
            "num_requests": args.num_requests, "skip": args.skip, "max_input_tokens": args.clips[workload],
            "max_output_tokens": args.max_output_tokens, "slo": args.slo, "run_duration": args.run_duration,
            "cluster_args": dc.CLUSTER_ARGS, "up_args": dc.mode_args(mode, workload)}


def recorded_run(out: Path, settings: dict) -> dict | None:
    """The row of a run recorded in ``out`` with exactly ``settings``, else ``None``."""
    try:
        saved = json.loads((out / "row.json").read_text())
    except (OSError, ValueError):
        return None
    return saved.get("row") if saved.get("settings") == json.loads(json.dumps(settings)) else None


def measure_point(state: dict | None, args, workload: str, mode: str, rate: float, baseline: float) -> dict:
    """``--repetitions`` gated runs at one rate (with ``--resume``, runs recorded earlier with the same
    settings are kept, not run again; with ``--report-only`` only those, ``state`` None); returns
    ``{"rate", "runs", "skipped_runs", "stats"}``."""
    point: dict = {"rate": rate, "runs": [], "skipped_runs": []}
    for rep in range(args.repetitions):
        out = args.results_dir / "runs" / workload / mode / f"rate_{rate:g}" / f"rep_{rep}"
        settings = run_settings(args, workload, mode, rate, rep)
        if (args.resume or args.report_only) and (row := recorded_run(out, settings)) is not None:
            log(f"[{workload}/{mode}] rate {rate:g} rep {rep}: kept from an earlier invocation ({out})")
            point["runs"].append(row | from_records(out, args) | {"resumed": True})
            args.model = getattr(args, "model", None) or recorded_model(out)
            continue
        if args.report_only:
            log(f"[{workload}/{mode}] rate {rate:g} rep {rep}: not recorded ({out})")
            continue
        gate = ds.wait_for_load(lambda: os.getloadavg()[0], time.sleep, time.monotonic, max_load=args.max_load,
                                idle_baseline=baseline, wait_s=args.load_wait_s, poll_s=args.load_poll_s)
        tag = f"[{workload}/{mode}] rate {rate:g} rep {rep}: load {gate['load_1m']:.2f} (gate {gate['gate_value']:.2f})"
        if not gate["ok"]:
            log(f"{tag} > {args.max_load:g} after {gate['waited_s']:.0f} s: not recorded")
            point["skipped_runs"].append({"rep": rep, **gate})
            continue
        cpu0, t0, prof0 = dc.cluster_cpu_s(state), time.monotonic(), dp.snapshot(state)
        summary = dc.replay(state, workload_config(args, workload, rate, args.num_requests, args.seed + rep), args, out)
        args.model, wall = summary["model"], max(time.monotonic() - t0, 1e-9)
        row = dc.row_of(summary, rep, gate) | {"cluster_cpu_cores": (dc.cluster_cpu_s(state) - cpu0) / wall,
                                               "profile": dp.profile(prof0, dp.snapshot(state), wall)}
        row |= from_records(out, args)
        log(f"{tag}: attainment {row['slo_attainment']:.2f}, goodput {row['goodput']:.3f} req/s, "
            f"ITL p99 {_ms(row['itl_p99_ms'])}, TTFT p99 {_ms(row['ttft_p99_ms'])}")
        out.mkdir(parents=True, exist_ok=True)
        (out / "row.json").write_text(json.dumps({"settings": settings, "row": row}, indent=1))
        point["runs"].append(row)
    point["stats"] = ds.aggregate_point(point["runs"])
    return point


def from_records(out: Path, args) -> dict:
    """What the run recorded in ``out`` gives from its per-request records (``requests.jsonl``):
    :func:`_disagg_stats.itl_by_gap` of its completed requests and ``attainment_by_slo_scale``
    (:func:`_disagg_stats.attainment_by_scale` at ``--slo-scales``); ``{}`` when the file is missing."""
    try:
        lines = (out / "requests.jsonl").read_text().splitlines()
    except OSError:
        return {}
    records = [RequestRecord.from_dict(json.loads(line)) for line in lines if line.strip()]
    return ds.itl_by_gap(r.token_times_s for r in records if r.ok) | {
        "attainment_by_slo_scale": ds.attainment_by_scale(records, args.slo_obj, args.slo_scales)}


def recorded_model(out: Path) -> str | None:
    """The model a recorded run served (its ``summary.json``); None when unreadable."""
    try:
        return json.loads((out / "summary.json").read_text()).get("model")
    except (OSError, ValueError):
        return None


def warm_up(state: dict, args, workload: str) -> dict:
    """The unrecorded warm-up replay of ``workload``; ``{"requests", "completed", "duration_s"}``."""
    if args.warmup_requests == 0:
        return {"requests": 0, "completed": 0, "duration_s": 0.0}
    wl = workload_config(args, workload, args.rates[0], args.warmup_requests, args.seed + 1000)
    s = dc.replay(state, wl, args, None)
    return {"requests": args.warmup_requests, "completed": s["completed"], "duration_s": s["duration_s"]}


def run_mode(mode: str, args, rates_by_workload: dict) -> dict:
    """Per workload, up (the mode's arguments for it), warm-up, idle baseline and sweep; returns
    ``{"up_args": {workload: args}, "clusters": {workload: {"skipped"?, "ray_head_pid", "warmup",
    "idle_baseline"}}, "workloads": {workload: [point, ...]}}``."""
    entry: dict = {"up_args": {w: dc.mode_args(mode, w) for w in args.workloads}, "clusters": {},
                   "workloads": {w: [] for w in args.workloads}}
    for workload in args.workloads:
        with dc.cluster(mode, workload) as (state, reason):
            if state is None:
                log(f"[{workload}/{mode}] skipped: {reason}")
                entry["clusters"][workload] = {"skipped": reason}
                continue
            # the Ray head's pid: its session is gone after down (the smoke test checks)
            c = entry["clusters"][workload] = {"ray_head_pid": state.get("ray_head_pid")}
            c["warmup"] = warm_up(state, args, workload)
            log(f"[{workload}/{mode}] warm-up: {c['warmup']}")
            if args.idle_baseline is None:
                c["idle_baseline"] = dc.idle_cpu_cores(state, args.baseline_window_s) | {"measured": True}
            else:
                c["idle_baseline"] = {"cores": args.idle_baseline, "measured": False}
            log(f"[{workload}/{mode}] idle baseline: {c['idle_baseline']}")
            sweep(entry, mode, args, workload, rates_by_workload[workload], state, c["idle_baseline"]["cores"])
    return entry


def report_mode(mode: str, args, rates_by_workload: dict) -> dict:
    """:func:`run_mode` for ``--report-only``: the points from recorded runs, no cluster."""
    entry: dict = {"up_args": {w: dc.mode_args(mode, w) for w in args.workloads}, "report_only": True,
                   "clusters": {}, "workloads": {w: [] for w in args.workloads}}
    for workload in args.workloads:
        sweep(entry, mode, args, workload, rates_by_workload[workload], None, 0.0)
    return entry


def sweep(entry: dict, mode: str, args, workload: str, rates: list[float], state: dict | None,
          baseline: float) -> None:
    """Measure (or, with ``--report-only``, collect) every point of ``mode`` on ``workload`` into
    ``entry``; colocated stops raising the rate after the first rate whose mean attainment is below
    ``--stop-below-attainment``."""
    for rate in rates:
        point = measure_point(state, args, workload, mode, rate, baseline)
        if args.report_only and not point["runs"]:
            continue  # a rate this workload was never run at (the rates are shared by the workloads)
        entry["workloads"][workload].append(point)
        if mode == "colocated" and ds.should_stop(point, args.stop_below_attainment):
            log(f"[{workload}/colocated] mean attainment below {args.stop_below_attainment}: stop at {rate:g}")
            break


def build_result(args, modes: dict, started: str) -> dict:
    """The JSON document: config, machine, modes, and per workload its points and targets."""
    workloads = {}
    for w in args.workloads:
        per_mode = {m: {"points": e["workloads"].get(w, []),
                        "distserve_goodput": ds.distserve_goodput(e["workloads"].get(w, []), args.attainment_target),
                        "goodput_by_slo_scale": ds.goodput_by_scale(e["workloads"].get(w, []), args.slo_scales,
                                                                    args.attainment_target)}
                    for m, e in modes.items()}
        empty: list = []
        workloads[w] = {"trace": WORKLOADS[w][0], "max_input_tokens": args.clips[w], "modes": per_mode,
                        "targets": ds.targets(per_mode.get("disaggregated", {}).get("points", empty),
                                              per_mode.get("colocated", {}).get("points", empty),
                                              args.attainment_target)}
    return {
        "started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "model": getattr(args, "model", None),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": {"rates": args.rates, "repetitions": args.repetitions, "num_requests": args.num_requests,
                   "workloads": args.workloads, "skip": args.skip, "max_output_tokens": args.max_output_tokens,
                   "slo": args.slo, "slo_scales": args.slo_scales, "attainment_target": args.attainment_target,
                   "stop_below_attainment": args.stop_below_attainment, "warmup_requests": args.warmup_requests,
                   "max_load": args.max_load, "load_wait_s": args.load_wait_s, "cluster_args": dc.CLUSTER_ARGS},
        "modes": {m: {k: v for k, v in e.items() if k != "workloads"} for m, e in modes.items()},
        "workloads": workloads,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    rates = {w: list(args.rates) for w in args.workloads}
    modes: dict = {}
    for mode in dc.MODES:  # colocated first
        if mode not in args.modes:
            continue
        modes[mode] = (report_mode if args.report_only else run_mode)(mode, args, rates)
        if mode == "colocated":  # disaggregated runs colocated's rates (all of them where colocated was not up)
            rates = {w: [p["rate"] for p in modes[mode]["workloads"][w]] or rates[w] for w in args.workloads}
    result = build_result(args, modes, started)
    stem, _ = write_results(result, args.results_dir, "disagg_vs_colocated", _disagg_report.markdown)
    _disagg_report.write_plot(stem.with_suffix(".png"), result)
    log(f"wrote {stem}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
