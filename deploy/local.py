"""``pdcluster up / down / status``: bring a cluster up on local (or given) Ray + Redis.

``up --local`` starts a Ray head (``ray start --head``) and a Redis server as
background daemons unless ``--ray-address`` / ``--redis-url`` name existing ones,
places the workers and the router (:mod:`deploy.cluster`), waits until all are
healthy, writes a state file (``<state-dir>/cluster.json``) and returns.
``down`` stops exactly what ``up`` started, as recorded in the state file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import ray

from deploy.cluster import ClusterSpec, launch, teardown
from deploy.ray_env import LOOPBACK_ENV
from deploy.state import DEFAULT_STATE_DIR, read_state, state_path
from deploy.redis_server import LocalRedisServer, free_port, stop_redis_at
from engine.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from engine.model_loader import resolve_model
from pdcluster.registry import WorkerRegistry
from router.server import RouterConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def num_kv_blocks(model: ModelConfig, block_size: int, dtype: str, kv_cache_gb: float) -> int:
    """Blocks that fit in ``kv_cache_gb`` GiB of KV cache."""
    per_block = block_size * model.kv_bytes_per_token(_DTYPE_BYTES[dtype])
    return max(2, int(kv_cache_gb * (1 << 30) // per_block))


def spec_from_args(args, redis_url: str) -> ClusterSpec:
    folder = resolve_model(args.model)  # dequantize once here, not in every worker
    model_cfg = ModelConfig.from_hf_folder(folder, name=args.model)
    kv_dtype = "float32" if args.dtype in ("auto", "float32") and args.device != "cuda" else (
        "bfloat16" if args.dtype == "auto" else args.dtype)
    blocks = args.num_kv_blocks or num_kv_blocks(model_cfg, args.block_size, kv_dtype, args.kv_cache_gb)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=args.max_model_len)
    worker = WorkerConfig(role="prefill", worker_id="template", model=args.model, redis_url=redis_url,
                          cluster=args.cluster, host=args.host, device=args.device, dtype=args.dtype,
                          heartbeat_s=args.heartbeat_s,
                          cache=CacheConfig(block_size=args.block_size, num_blocks=blocks, dtype=kv_dtype),
                          scheduler=sched)
    router = RouterConfig(model=args.model, redis_url=redis_url, cluster=args.cluster, host=args.host,
                          port=args.port, max_model_len=args.max_model_len, block_size=args.block_size,
                          view_period_s=args.heartbeat_s / 4)
    return ClusterSpec(args.prefill, args.decode, worker, router, timeout_s=args.timeout_s)


def start_ray_head(state_dir: Path, timeout_s: float = 120.0) -> tuple[str, int]:
    """Start a Ray head on loopback (``ray start --head --block`` in its own session, so
    ``down`` can stop exactly this cluster); returns ``(address, pid)``.

    Raises:
        RuntimeError: the head exited or did not answer within ``timeout_s`` (with its log).
    """
    port = free_port()
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    cmd = [ray_bin, "start", "--head", "--block", f"--port={port}", "--include-dashboard=false",
           "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
    log_path = state_dir / "ray-head.log"
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **LOOPBACK_ENV})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        if "Ray runtime started" in log_path.read_text():
            return f"127.0.0.1:{port}", proc.pid
        time.sleep(0.2)
    stop_ray_head(proc.pid)
    raise RuntimeError(f"Ray head did not start within {timeout_s:.0f}s; see {log_path}")


def stop_ray_head(pid: int, timeout_s: float = 30.0) -> None:
    """Stop the Ray head started by :func:`start_ray_head` and every process of its session."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_healthy(redis_url: str, cluster: str, expected: int, router_address: str, timeout_s: float) -> None:
    """Wait until ``expected`` workers heartbeat and the router's health says SERVING.

    Raises:
        TimeoutError: naming what is still missing.
    """
    from pdcluster.client import PdclusterClient

    reg = WorkerRegistry(redis_url, cluster)
    deadline = time.monotonic() + timeout_s
    live = []
    while time.monotonic() < deadline:
        live = reg.live_workers()
        if len([w for w, _ in live if w.role in ("prefill", "decode")]) >= expected:
            break
        time.sleep(0.2)
    else:
        raise TimeoutError(f"only {len(live)} of {expected} workers registered within {timeout_s:.0f}s")
    with PdclusterClient(router_address) as client:
        client.wait_ready(max(1.0, deadline - time.monotonic()))


def up(args) -> dict:
    """Bring the cluster up and write the state file; returns the state dict."""
    state_dir = Path(args.state_dir or DEFAULT_STATE_DIR).expanduser()
    state_dir.mkdir(parents=True, exist_ok=True)
    if state_path(state_dir).exists():
        raise RuntimeError(f"a cluster is already up (state in {state_path(state_dir)}); run `pdcluster down`")
    state: dict = {"started_ray": False, "started_redis": False}
    try:
        if args.redis_url:
            redis_url = args.redis_url
        else:
            redis = LocalRedisServer(state_dir / "redis", detach=True).start()
            redis_url = redis.url
            state.update(started_redis=True, redis_pid=redis.pid)
        state["redis_url"] = redis_url
        if args.ray_address:
            ray_address = args.ray_address
        elif args.local:
            if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
                raise RuntimeError("call deploy.ray_env.use_loopback_ray() before importing ray for --local")
            ray_address, head_pid = start_ray_head(state_dir)
            state.update(started_ray=True, ray_head_pid=head_pid)
        else:
            raise RuntimeError("give --local (start Ray here) or --ray-address ADDR")
        state["ray_address"] = ray_address
        ray.init(address=ray_address, namespace="pdcluster", logging_level="WARNING")
        spec = spec_from_args(args, redis_url)
        state.update(launch(spec))
        wait_healthy(redis_url, args.cluster, args.prefill + args.decode, state["router_address"], args.timeout_s)
    except BaseException:
        _cleanup(state)
        raise
    finally:
        if ray.is_initialized():
            ray.shutdown()
    state_path(state_dir).write_text(json.dumps(state, indent=2))
    return state


def _cleanup(state: dict) -> None:
    if state.get("workers") and ray.is_initialized():
        teardown(state)
    if ray.is_initialized():
        ray.shutdown()
    if state.get("started_ray"):
        stop_ray_head(state["ray_head_pid"])
    if state.get("started_redis"):
        stop_redis_at(state["redis_url"])


def down(state_dir: Path | str | None = None) -> bool:
    """Stop what ``up`` started. Returns False when no cluster was up."""
    try:
        state = read_state(state_dir)
    except FileNotFoundError:
        return False
    try:
        ray.init(address=state["ray_address"], namespace="pdcluster", logging_level="WARNING")
    except Exception as e:  # noqa: BLE001 - Ray already gone: nothing to kill there
        print(f"ray at {state.get('ray_address')} unreachable ({e}); skipping actor teardown", file=sys.stderr)
        state.pop("workers", None)
    _cleanup(state)
    state_path(state_dir).unlink(missing_ok=True)
    return True


def cmd_up(args) -> int:
    state = up(args)
    print(f"pdcluster is up: router at {state['router_address']} "
          f"({args.prefill} prefill + {args.decode} decode workers, redis {state['redis_url']})")
    print(state["router_address"])
    return 0


def cmd_down(args) -> int:
    print("pdcluster is down" if down(args.state_dir) else "no pdcluster was up")
    return 0


def cmd_status(args) -> int:
    from deploy.status import print_status

    try:
        state = read_state(args.state_dir)
    except FileNotFoundError:
        print("no pdcluster is up", file=sys.stderr)
        return 1
    return print_status(state, as_json=args.json)
