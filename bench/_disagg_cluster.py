"""The cluster side of ``bench/disagg_vs_colocated.py``: bring a mode's local cluster up and
down, measure what it costs when idle, warm it up, and replay one measured run.

Times in seconds (``_s``), CPU use in cores (CPU-seconds per wall second).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from loadtest.driver import run_loadtest
from loadtest.runner import RunConfig
from loadtest.workload import WorkloadConfig
from pdcluster.cli import build_parser

CONVERSATION_DISAGG_ARGS = ["--prefill", "1", "--decode", "1", "--prefill-max-num-batched-tokens", "512"]
"""Extra ``pdcluster up`` arguments of the disaggregated mode on the conversation workload: each
worker on its CPU share (1 torch thread, as each colocated worker), the prefill worker's steps
stopped at 512 tokens.

Threads, measured at 4 req/s (100 requests, SLO ttft=2s,tpot=200ms): with ``--prefill-threads 2``
the prefill worker's steps ran at 510 prompt tokens/s (the engine alone reaches ~810 at 2
threads, ~400-650 at 1): its 2 threads share the cores with the busy decode worker's thread, and
every parallel operator's barrier waits for the descheduled one; its queue grew (TTFT mean
1.75 s, attainment 0.58). With 1 thread each: TTFT mean 0.59 s, TPOT 34 ms (64 ms with 2),
attainment 1.00.

Token budget: a prefill worker only prefills, and DistServe (Zhong et al., OSDI 2024, §4.1)
batches prefills only up to the length where a step is compute-bound: every prompt of a step gets
its first token at the step's end, so a longer step only delays the first prompts of a burst.
On this CPU at 1 thread a step is compute-bound from 128 tokens on (``bench/results/prefill.md``:
407 prompt tokens/s at 128-token steps, 317 at 2048)."""

CODE_DISAGG_ARGS = ["--prefill", "1", "--decode", "1", "--prefill-threads", "2"]
"""Extra ``pdcluster up`` arguments of the disaggregated mode on the code workload: the prefill
worker on 2 torch threads, the decode worker on 1. The code trace sends bursts of long prompts
(up to 384 tokens) and then nothing for minutes, and its 16-token outputs leave the decode worker
idle 94 % of a run, so the prefill worker's second thread finds a free core. Measured at 0.2
req/s (SLO attainment; one run each unless noted): 1 thread and a 512-token budget 0.17 (prefill
at 561 prompt tokens/s, TTFT p99 7.3 s), 1 thread and 2048 tokens 0.45, 2 threads and 2048 tokens
0.51 (3 runs). As DistServe sizes each phase's parallelism per workload, the modes' arguments are
per workload: :data:`MODES`."""

COLOCATED_ARGS = ["--colocated", "--workers", "2"]
"""Extra ``pdcluster up`` arguments of the colocated mode (2 workers, prefill + decode on each,
1 torch thread each), on both workloads."""

MODES = {"colocated": {"conversation": COLOCATED_ARGS, "code": COLOCATED_ARGS},
         "disaggregated": {"conversation": CONVERSATION_DISAGG_ARGS, "code": CODE_DISAGG_ARGS}}
"""Mode -> workload -> its extra ``pdcluster up`` arguments; colocated runs first (its attainment
decides where the sweep stops). Each (mode, workload) gets its own cluster."""

CLUSTER_ARGS = ["--max-model-len", "512", "--block-size", "16", "--num-kv-blocks", "800", "--heartbeat-s", "0.5"]
"""``pdcluster up`` arguments shared by both modes."""

METRICS = (("ttft_p50_ms", "ttft_ms", "p50"), ("ttft_p99_ms", "ttft_ms", "p99"), ("itl_p99_ms", "itl_ms", "p99"),
           ("tpot_mean_ms", "tpot_ms", "mean"), ("tpot_p99_ms", "tpot_ms", "p99"))
"""(row key, summary key, statistic) of the latency figures kept per run."""


def up_args(mode_args: list[str], state_dir: Path):
    """Parse ``pdcluster up`` arguments of a mode; ``(None, reason)`` when the parser rejects them."""
    argv = ["up", "--local", "--port", "0", "--state-dir", str(state_dir), *CLUSTER_ARGS, *mode_args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv), ""
    except SystemExit:
        return None, f"`pdcluster {' '.join(argv[:2])} ... {' '.join(mode_args)}` rejected: " + \
            err.getvalue().strip().splitlines()[-1]


def mode_args(mode: str, workload: str) -> list[str]:
    """The extra ``pdcluster up`` arguments of ``mode`` on ``workload`` (:data:`MODES`)."""
    return MODES[mode][workload]


@contextlib.contextmanager
def cluster(mode: str, workload: str) -> Iterator[tuple[dict | None, str]]:
    """``with cluster(mode, workload) as (state, reason)``: the mode's local cluster for that
    workload is up inside the block (``state`` is ``pdcluster up``'s state dict) and down after
    it; ``(None, reason)`` when its arguments are rejected or ``up`` fails (nothing is left running)."""
    from deploy import local

    state_dir = Path(tempfile.mkdtemp(prefix=f"bench-{mode}-"))
    up, reason = up_args(mode_args(mode, workload), state_dir)
    if up is None:
        yield None, reason
        return
    try:
        state = local.up(up)
    except Exception as exc:  # noqa: BLE001 - reported in the result, the other mode still runs
        local.down(state_dir)
        yield None, f"`up` failed: {exc!r}"
        return
    try:
        yield state, ""
    finally:
        local.down(state_dir)


def _proc_stat(pid: str) -> tuple[int, int, float] | None:
    """``(pid, session id, utime + stime in seconds)`` of ``/proc/<pid>/stat``; None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(pid), int(fields[3]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cluster_cpu_s(state: dict) -> float:
    """CPU seconds used so far by the cluster's processes: every process of the Ray head's
    session (``ray start`` runs in its own session: GCS, raylet, the workers' and router's
    actors), the Redis server ``up`` started, and this process (the Ray driver)."""
    sid, own = state.get("ray_head_pid"), {os.getpid(), state.get("redis_pid")}
    total = 0.0
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        st = _proc_stat(pid)
        if st is not None and (st[1] == sid or st[0] in own):
            total += st[2]
    return total


def idle_cpu_cores(state: dict, window_s: float) -> dict:
    """Mean CPU use of the idle cluster (cores) over ``window_s`` seconds of sleeping: what
    its heartbeats, health checks and Ray's own loops add to the load average on an
    otherwise idle machine. Returns ``{"cores", "window_s", "load_1m_start", "load_1m_end"}``."""
    load0, c0, t0 = os.getloadavg()[0], cluster_cpu_s(state), time.monotonic()
    time.sleep(window_s)
    c1, t1 = cluster_cpu_s(state), time.monotonic()
    return {"cores": (c1 - c0) / (t1 - t0), "window_s": t1 - t0, "load_1m_start": load0,
            "load_1m_end": os.getloadavg()[0]}


def replay(state: dict, workload: WorkloadConfig, args, out: Path | None) -> dict:
    """Replay ``workload`` against the cluster's router (bounded by ``--run-duration`` and
    ``--drain-timeout``); writes the run's files under ``out`` when given. Returns the
    loadtest summary."""
    run = RunConfig(address=state["router_address"], duration_s=args.run_duration,
                    drain_timeout_s=args.drain_timeout)
    return run_loadtest(workload, run, slo=args.slo_obj, output_dir=out, plots=False, progress=False).summary


def row_of(summary: dict, rep: int, gate: dict) -> dict:
    """One measured run's record: counts, throughputs, SLO attainment, goodput, the
    :data:`METRICS` latencies (ms; None without completions) and the load gate's reading."""
    return {"rep": rep, "load_1m_before": gate["load_1m"], "gate_value": gate["gate_value"],
            "load_waited_s": gate["waited_s"], "sent": summary["sent"], "completed": summary["completed"],
            "failed": summary["failed"], "duration_s": summary["duration_s"],
            "request_throughput": summary["request_throughput"], "output_throughput": summary["output_throughput"],
            "slo_attainment": summary["slo_attainment"], "goodput": summary["goodput"],
            **{name: (summary.get(key) or {}).get(stat) for name, key, stat in METRICS}}
