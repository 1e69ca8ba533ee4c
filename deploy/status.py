"""``pdcluster status``: the live workers of a cluster, from the Redis registry."""

from __future__ import annotations

import json
import sys
import time

from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table

from serving.registry import WorkerRegistry


def collect(state: dict) -> list[dict]:
    """One dict per live worker: id, role, address, node, load and KV blocks."""
    reg = WorkerRegistry(state["redis_url"], state["cluster"])
    rows = []
    for info, load in reg.live_workers():
        rows.append({
            "worker_id": info.worker_id, "role": info.role, "address": info.address,
            "node_id": info.node_id[:12], "num_waiting": load.num_waiting, "num_running": load.num_running,
            "num_free_blocks": load.num_free_blocks, "num_total_blocks": load.num_total_blocks,
            "draining": load.draining, "heartbeat_age_s": round(time.time() - load.updated_at, 2),
        })
    return rows


def print_status(state: dict, as_json: bool = False) -> int:
    """Print the live workers (a table, or JSON); returns 0, or 1 when the cluster's Redis
    cannot be reached (one line on stderr)."""
    try:
        rows = collect(state)
    except RedisError as e:
        print(f"error: cannot reach the cluster's Redis: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps({"router_address": state["router_address"], "workers": rows}, indent=2))
        return 0
    table = Table(title=f"pdcluster '{state['cluster']}' — router {state['router_address']}")
    for col in ("worker", "role", "address", "node", "waiting", "running", "free KV blocks", "heartbeat age"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["worker_id"], r["role"], r["address"], r["node_id"], str(r["num_waiting"]),
                      str(r["num_running"]), f"{r['num_free_blocks']}/{r['num_total_blocks']}",
                      f"{r['heartbeat_age_s']:.1f}s")
    Console(width=160).print(table)
    return 0
