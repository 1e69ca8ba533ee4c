"""``pdcluster status``: the live workers and routers of a cluster (from the Redis registry)
against the desired ones (from the cluster controller's report, :mod:`deploy.controller`), and
why a missing worker is missing."""

from __future__ import annotations

import json
import shlex
import sys
import time

from redis.exceptions import RedisError, ResponseError
from rich.console import Console
from rich.table import Table

from deploy.ray_env import ray_answers
from serving.registry import CONTROLLER_REPORT_KEY, WORKER_ROLES, WorkerRegistry

ROLES = WORKER_ROLES


def collect(state: dict) -> dict:
    """``{workers: [one dict per live worker], desired: {role: n}, live: {role: n},
    missing: [{worker_id, role, reason, restarts}] (desired routers without a record too: role
    ``router``; reason and restarts from the controller's report, restarts ``None`` without one),
    controller: bool, controller_report_age_s: seconds (None without a report; reports expire
    when the controller stops), ray_up: whether the Ray head answers (nothing heals without it),
    routers: {desired: n, live: [{index, router_id, pid, address, metrics_address, started_at}]}}``.

    Raises:
        redis.exceptions.RedisError: the cluster's Redis cannot be reached.
    """
    reg = WorkerRegistry(state["redis_url"], state["cluster"])
    try:
        rows = []
        for info, load in reg.live_workers():
            rows.append({
                "worker_id": info.worker_id, "role": info.role, "address": info.address, "pid": info.pid,
                "generation": info.generation, "node_id": info.node_id[:12], "num_waiting": load.num_waiting,
                "num_running": load.num_running, "num_free_blocks": load.num_free_blocks,
                "num_total_blocks": load.num_total_blocks, "draining": load.draining,
                "heartbeat_age_s": round(time.time() - load.updated_at, 2),
            })
        routers = [{"index": r.index, "router_id": r.router_id, "pid": r.pid, "address": r.address,
                    "metrics_address": r.metrics_address, "started_at": r.started_at} for r in reg.live_routers()]
        report = reg.get_state(CONTROLLER_REPORT_KEY)
    finally:
        reg.close()
    live_ids = {r["worker_id"] for r in rows}
    desired_workers = report["workers"] if report else [{"worker_id": w["worker_id"], "role": w["role"]}
                                                        for w in state.get("workers", [])]
    missing = [{"worker_id": w["worker_id"], "role": w["role"],
                "reason": w.get("reason") or "no heartbeat", "restarts": w.get("restarts", 0)}
               for w in desired_workers if w["worker_id"] not in live_ids]
    live_routers = {r["index"] for r in routers}
    router_why = (report or {}).get("routers", {}).get("missing", {})  # the controller's reasons
    missing += [{"worker_id": f"router-{i}", "role": "router",
                 "reason": router_why.get(str(i), {}).get("reason") or "no router record (its process died or "
                 "Redis restarted; Ray restarts a router on the same address within seconds)",
                 "restarts": router_why.get(str(i), {}).get("restarts")}
                for i in range(state.get("num_routers", 1)) if i not in live_routers]
    return {"workers": rows, "missing": missing, "controller": report is not None,
            "ray_up": ray_answers(state["ray_address"]),
            "controller_report_age_s": round(time.time() - report.get("updated_at", 0), 2) if report else None,
            "routers": {"desired": state.get("num_routers", 1), "live": routers},
            "desired": {r: sum(w["role"] == r for w in desired_workers) for r in ROLES},
            "live": {r: sum(w["role"] == r for w in rows) for r in ROLES}}


def redis_down_message(state: dict, state_dir: str | None, error: Exception) -> str:
    """The one line for a cluster whose Redis does not answer: Redis is restarting (the cluster
    controller restarts the local one ``up`` started within seconds) while the cluster's Ray head
    answers; with the Ray head gone too, the cluster is dead and ``pdcluster down`` clears what is
    left of it."""
    if not ray_answers(state["ray_address"]):
        flag = f" --state-dir {shlex.quote(str(state_dir))}" if state_dir else ""
        return (f"error: neither the cluster's Redis nor its Ray head at {state['ray_address']} answers: the "
                f"cluster is down (its processes died?); clear what is left of it with `pdcluster down{flag}`")
    if not state.get("started_redis"):  # --redis-url: nobody here restarts it
        return f"error: cannot reach the cluster's Redis ({error}); it is the one given to `up --redis-url`"
    return (f"error: cannot reach the cluster's Redis ({error}); the cluster controller restarts a local one "
            "within seconds: try again")


def print_status(state: dict, as_json: bool = False, state_dir: str | None = None) -> int:
    """Print the live workers against the desired ones (a table, or JSON); returns 0, 1 when
    the cluster's Redis cannot be reached (one line on stderr, :func:`redis_down_message`; with
    ``as_json`` also ``{"up": true, "redis_ok": false, "error": ...}`` on stdout), 3 when a desired
    worker or router is missing."""
    try:
        st = collect(state)
    except RedisError as e:
        if isinstance(e, ResponseError):  # Redis answers, with an error: not "unreachable"
            message = (f"error: the cluster's Redis answered with an error ({e}); a key under the cluster's prefix "
                       f"'pdcluster:{state['cluster']}:' may hold a value of another type than pdcluster wrote")
        else:
            message = redis_down_message(state, state_dir, e)
        print(message, file=sys.stderr)
        if as_json:  # a script reading stdout gets a document too
            print(json.dumps({"up": True, "redis_ok": False, "error": message.removeprefix("error: ")}, indent=2))
        return 1
    if as_json:
        print(json.dumps({"up": True, "router_address": state["router_address"],
                          "router_http_address": state.get("router_http_address", ""),
                          "logs": _logs_dir(state),
                          **st}, indent=2))
        return 3 if st["missing"] else 0
    http = f", HTTP {state['router_http_address']}" if state.get("router_http_address") else ""
    table = Table(title=f"pdcluster '{state['cluster']}' — router {state['router_address']}{http}")
    for col in ("worker", "role", "gen", "address", "pid", "waiting", "running", "free KV blocks", "heartbeat age"):
        table.add_column(col)
    for r in st["workers"]:
        role = f"{r['role']} (draining)" if r["draining"] else r["role"]
        table.add_row(r["worker_id"], role, str(r["generation"]), r["address"], str(r["pid"]),
                      str(r["num_waiting"]), str(r["num_running"]), f"{r['num_free_blocks']}/{r['num_total_blocks']}",
                      f"{r['heartbeat_age_s']:.1f}s")
    console = Console(width=160)
    console.print(table)
    counts = ", ".join(f"{st['live'][r]}/{n} {r}" for r, n in st["desired"].items() if n)
    routers = st["routers"]
    counts += f", {len(routers['live'])}/{routers['desired']} routers"
    console.print(f"live/desired: {counts}")
    console.print(f"controller: last report {st['controller_report_age_s']:.1f}s ago" if st["controller"] else
                  "controller: no report (not running, or restarting): dead workers are not replaced meanwhile")
    if not st["ray_up"]:
        flag = f" --state-dir {shlex.quote(str(state_dir))}" if state_dir else ""
        console.print(f"ray: the cluster's Ray head at {state['ray_address']} does not answer: the cluster is down "
                      f"and nothing restarts its workers or routers; clear what is left of it with "
                      f"`pdcluster down{flag}`", soft_wrap=True)
    for r in routers["live"]:
        console.print(f"{r['router_id']}: pid {r['pid']}, metrics at {r['metrics_address']}")
    for m in st["missing"]:
        restarts = f"; restarts {m['restarts']}" if m["restarts"] is not None else ""
        console.print(f"missing: {m['worker_id']} ({m['role']}): {m['reason']}{restarts}")
    if _logs_dir(state):
        console.print(f"logs: {_logs_dir(state)} on each node; a process' lines are in "
                      "worker-*-<pid>.err (pid above; the controller's and a crashed process' too)", soft_wrap=True)
    return 3 if st["missing"] else 0


def _logs_dir(state: dict) -> str:
    """The processes' log folder on each node (the Ray session's ``logs``; ``""`` when not recorded)."""
    return f"{state['ray_session_dir']}/logs" if state.get("ray_session_dir") else ""


def cmd_status(args) -> int:
    """``pdcluster status``: the table (or ``--json``) of the cluster up from ``--state-dir``; 1 when none is.
    Imports no torch, transformers or Ray: it reads the state file and Redis only."""
    from deploy.state import no_cluster_text, read_state

    try:
        state = read_state(args.state_dir)
    except FileNotFoundError:
        if args.json:  # a script reading stdout gets JSON either way
            print(json.dumps({"up": False}))
        print(no_cluster_text(args.state_dir), file=sys.stderr)
        return 1
    return print_status(state, as_json=args.json, state_dir=args.state_dir)
