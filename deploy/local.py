"""``pdcluster up / down / status``: bring a cluster up on local (or given) Ray + Redis.

``up --local`` starts a Ray head (``ray start --head``, on loopback, advertising
``--ray-resources``) and a Redis server as background daemons; ``up --ray-address``
joins a running Ray cluster instead (run it on the head node: Redis and the router
go there) and starts Redis there unless ``--redis-url`` names one. It places the
workers and the router (:mod:`deploy.cluster`), waits until all are healthy,
writes a state file (``<state-dir>/cluster.json``, mode 0600: it holds the cluster secret
``up`` generates for the internal plane, :mod:`serving.security`, and with ``--internal-tls``
the cluster CA's certificate and key, :mod:`serving.certs`) and returns. ``down`` stops
exactly what ``up`` started, as recorded in the state file.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import sys
import time
from functools import partial
from pathlib import Path
from urllib.parse import urlparse

import ray
import redis

from common.model_config import ConfigError
from deploy.cluster import NAMESPACE, WORKER_ROLES, actor_name, head_node_id, launch, teardown
from deploy.controller import HealConfig, RedisSpec, start_controller
from deploy.placement import PlacementError
from deploy.ray_env import STATE_TOKEN_KEY, check_ray_reachable, ray_answers, ray_token
from deploy.ray_node import start_ray_head, stop_ray_head
from deploy.ray_watch import HeadWatch
from deploy.redis_control import pid_alive, stop_redis_at, wait_pid_gone
from deploy.redis_server import LocalRedisServer
from deploy.redis_supervisor import server_process
from deploy.spec import exposure_warning, spec_from_args
from deploy.state import DEFAULT_STATE_DIR, AlreadyUpError, check_not_up, read_state, state_path, write_state
from engine.kernels.cpu.build import build_in_parallel as build_cpu_kernels
from engine.model_loader import ModelNotFoundError
from serving.certs import KeyPair, create_ca
from serving.registry import WorkerRegistry


def wait_healthy(redis_url: str, cluster: str, expected: int, router_address: str, timeout_s: float,
                 router_tls: bool = False) -> None:
    """Wait until ``expected`` workers heartbeat and the router's health says SERVING
    (``router_tls``: the router serves TLS with a certificate ``up`` need not trust, so its
    actor is asked instead of its health service).

    Raises:
        TimeoutError: naming what is still missing.
    """
    from pdcluster.client import PdclusterClient

    reg = WorkerRegistry(redis_url, cluster)
    deadline = time.monotonic() + timeout_s
    live = []
    while time.monotonic() < deadline:
        live = reg.live_workers()
        if len([w for w, _ in live if w.role in WORKER_ROLES]) >= expected:
            break
        time.sleep(0.2)
    else:
        raise TimeoutError(f"only {len(live)} of {expected} workers registered within {timeout_s:.0f}s")
    if router_tls:
        router = ray.get_actor(actor_name(cluster, "router"), namespace=NAMESPACE)
        while not ray.get(router.serving.remote(), timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"router at {router_address} not SERVING after {timeout_s}s")
            time.sleep(0.2)
        return
    with PdclusterClient(router_address) as client:
        client.wait_ready(max(1.0, deadline - time.monotonic()))


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """Whether the router could bind each of ``ports`` (flag -> port; 0 = any free port, not checked) on
    ``host``: a bind without ``SO_REUSEPORT`` fails where anything listens, a gRPC server (which sets it)
    included.

    Raises:
        common.model_config.ConfigError: a port is taken (naming its flag).
    """
    for flag, port in ports.items():
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise ConfigError(f"{flag} {port}: {host}:{port} is in use ({e.strerror}; another pdcluster "
                                  f"started without its own {flag}?); stop what listens there or choose another "
                                  f"port ({flag} 0: any free port)") from None


def _preflight(args) -> Path:
    """What ``up`` checks and prepares before it starts anything; returns the state directory. A bad flag,
    a state directory in use or (``--local``) a router port in use raise here (see :func:`up`); with
    ``--local`` the checkout's missing CPU kernels are built, in parallel and outside ``--timeout-s``
    (the workers share them)."""
    if not (args.local or args.ray_address):
        raise ConfigError("give --local (start Ray here) or --ray-address ADDR")
    if args.local and args.ray_address:
        raise ConfigError("give --local (start Ray here) or --ray-address ADDR, not both")
    state_dir = Path(args.state_dir or DEFAULT_STATE_DIR).expanduser()
    check_not_up(state_dir)  # at once: the spec below loads the model's config (seconds on a busy machine)
    checked = spec_from_args(args, "redis://127.0.0.1:0", use_cuda=args.device == "cuda")  # flag errors next
    warning = exposure_warning(checked.router)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if args.local:  # the router binds here: say so now, not after Ray, Redis and the workers started
        check_ports_free(args.host, {"--port": args.port, "--http-port": args.http_port if args.http else 0})
        build_cpu_kernels()
    return state_dir


def up(args) -> dict:
    """Bring the cluster up and write the state file; returns the state dict. On any
    failure everything ``up`` started (actors, placement groups, Ray head, Redis) is
    stopped again before the error propagates.

    Raises:
        deploy.placement.PlacementError: the workers' resources were not found within
            ``--placement-timeout-s`` (the message says what is missing).
        ValueError / common.model_config.ConfigError: a flag out of range (e.g. ``--ray-resources``
            not a JSON object of whole numbers), neither ``--local`` nor ``--ray-address``,
            ``--ray-address`` not run on the head node without ``--redis-url``.
        deploy.state.AlreadyUpError: a cluster is already up from ``--state-dir``.
        ConnectionError: ``--ray-address`` does not answer.
        RuntimeError: Ray, Redis, a worker or the router failed to start.
        TimeoutError: the workers or the router were not healthy within ``--timeout-s``.
    """
    state_dir = _preflight(args)
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # holds the cluster secret (state file, Redis' AOF)
    state: dict = {"started_ray": False, "started_redis": False, "cluster_secret": secrets.token_urlsafe(32)}
    if args.internal_tls:
        ca = create_ca(args.cluster)
        state.update(internal_ca_cert=ca.cert_pem.decode(), internal_ca_key=ca.key_pem.decode())
    watch = None
    try:
        state["ray_address"] = _ray_head(args, state, state_dir)
        watch = _watch_head(state, state_dir).start()
        context = ray.init(address=state["ray_address"], namespace="pdcluster", logging_level="WARNING")
        state["ray_session_dir"] = context.address_info.get("session_dir", "")  # logs: <it>/logs
        state["redis_url"] = args.redis_url or _start_redis(args, state, state_dir)
        use_cuda = ray.cluster_resources().get("GPU", 0) >= 1 and args.device in ("auto", "cuda")
        spec = spec_from_args(args, state["redis_url"], use_cuda, cluster_secret=state["cluster_secret"],
                              internal_ca=internal_ca(state))
        state.update(launch(spec))
        wait_healthy(state["redis_url"], args.cluster, sum(spec.counts().values()), state["router_address"],
                     args.timeout_s, router_tls=spec.router.security.public_tls)
        _start_controller(state, HealConfig(period_s=spec.worker.heartbeat_s, hung_after_s=args.hung_after_s),
                          args.timeout_s, spec.router)
        if not ray_answers(state["ray_address"]):  # died since its watch last looked (every 0.5 s)
            raise RuntimeError(f"the Ray head at {state['ray_address']} stopped answering as the cluster started")
    except BaseException:
        if watch is not None:
            watch.stop()  # _cleanup stops the head itself
        _cleanup(state)
        raise
    finally:
        if watch is not None:
            watch.stop()
        if ray.is_initialized():
            ray.shutdown()
    write_state(state_dir, state)
    return state


def _ray_head(args, state: dict, state_dir: Path) -> str:
    """The address of the Ray head ``up`` works with: ``--ray-address`` once it answers, or (``--local``)
    a head started here, recorded in ``state``. Raises as :func:`up` says."""
    if args.ray_address:
        if args.ray_resources:
            raise ValueError("--ray-resources applies to the Ray head `up --local` starts; with "
                             "--ray-address give the resources to `ray start` on each node")
        check_ray_reachable(args.ray_address)
        return args.ray_address
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        raise RuntimeError("call deploy.ray_env.use_loopback_ray() before importing ray for --local")
    resources = _json_object(args.ray_resources, "--ray-resources") if args.ray_resources else None
    ray_address, head_pid = start_ray_head(state_dir, resources=resources)
    state.update(started_ray=True, ray_head_pid=head_pid)
    state[STATE_TOKEN_KEY] = ray_token()  # scale and down present it (deploy.ray_env)
    return ray_address


def _watch_head(state: dict, state_dir: Path) -> HeadWatch:
    """A :class:`~deploy.ray_watch.HeadWatch` over the Ray head ``up`` works with: the head
    process it started (``--local``), or the address of the one it joined (3 refusals in a row).
    Should the head end, what ``up`` started outside Ray is stopped and the process exits with 1:
    Ray would end it 60 s later without running any cleanup."""
    if state["started_ray"]:
        pid = state["ray_head_pid"]
        alive, misses, why = partial(pid_alive, pid), 1, f"exited (its log: {state_dir / 'ray-head.log'})"
    else:
        alive, misses, why = partial(ray_answers, state["ray_address"]), 3, "stopped accepting connections"

    def lost() -> None:
        print(f"error: the Ray head at {state['ray_address']} {why} while `up` was starting the cluster; "
              "stopping what `up` started", file=sys.stderr, flush=True)
        if state["started_ray"]:
            stop_ray_head(state["ray_head_pid"], timeout_s=2.0)  # the rest of its session
        _cleanup(state, connected=False)
        sys.stdout.flush()
        os._exit(1)

    return HeadWatch(alive, lost, period_s=0.5, misses=misses)


def _start_controller(state: dict, heal: HealConfig, timeout_s: float, router) -> None:
    """Start the cluster controller (:mod:`deploy.controller`), supervising Redis where ``up``
    started it and keeping the ``router`` config's routers, and wait until it watches."""
    redis = (RedisSpec(state["redis_url"], state["redis_dir"], state.get("redis_pid"))
             if state.get("started_redis") else None)
    controller = start_controller(state, heal, redis, router)
    ray.get(controller.report.remote(), timeout=timeout_s)


def internal_ca(state: dict) -> KeyPair | None:
    """The cluster CA of the cluster ``state`` describes (``None``: no internal TLS)."""
    if "internal_ca_cert" not in state:
        return None
    return KeyPair(state["internal_ca_cert"].encode(), state["internal_ca_key"].encode())


def _json_object(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag} must be a JSON object, e.g. '{{\"CPU\": 4, \"prefill_node\": 1}}': {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value


def _start_redis(args, state: dict, state_dir: Path) -> str:
    """Start the registry's Redis on this (the head) node; returns its URL.

    It listens on this node's Ray IP address, so workers on other nodes reach it (on
    127.0.0.1 in a loopback-only local cluster), always with a random password (in the
    URL and the 0600 state file), and keeps an append-only file in ``<state-dir>/redis``:
    the cluster controller restarts it there when it dies (:mod:`deploy.redis_supervisor`).

    Raises:
        ConfigError: ``up`` does not run on the Ray head node (the router and Redis
            belong there).
        RuntimeError: Redis did not start.
    """
    if not args.local and ray.get_runtime_context().get_node_id() != head_node_id():
        raise ConfigError("run `pdcluster up --ray-address ...` on the Ray head node (e.g. `ray exec "
                          "cluster.yaml 'pdcluster up ...'`), or give --redis-url of a Redis every node reaches")
    host = "127.0.0.1" if args.local else ray.util.get_node_ip_address()
    password = secrets.token_hex(16)  # always: any local user could otherwise rewrite the registry
    redis = LocalRedisServer(state_dir / "redis", port=args.redis_port or None, host=host, detach=True,
                             password=password, persist=True).start()
    state.update(started_redis=True, redis_pid=redis.pid, redis_url=redis.url, redis_dir=str(state_dir / "redis"))
    return redis.url


def forget_ray_address(address: str | None) -> None:
    """Remove Ray's "current cluster" file (``/tmp/ray/ray_current_cluster``, which ``ray status`` and
    ``ray.init("auto")`` read) when it names ``address``, a head just stopped, as ``ray stop`` does;
    a file naming another cluster's head is left alone."""
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    try:
        if address and path.read_text().strip() == address:
            path.unlink()
    except OSError:  # no such file, or not ours to remove
        pass


def _cleanup(state: dict, connected: bool | None = None) -> None:
    """Stop what ``state`` records ``up`` started; ``connected``: whether Ray answers (by default
    whether this process is connected to it), so the cluster's actors can be killed through it."""
    if connected is None:  # a head that died leaves ray initialized, and a call through it hanging
        connected = ray.is_initialized() and ray_answers(state.get("ray_address", ""))
    if state.get("workers") and connected:
        teardown(state)
    if connected:
        ray.shutdown()
    if state.get("started_ray"):
        # with the actors killed there is nothing for the raylet's graceful exit (about 10 s) to stop
        stop_ray_head(state["ray_head_pid"], timeout_s=1.0 if connected else 10.0)
        forget_ray_address(state.get("ray_address"))
    if state.get("started_redis") and state.get("redis_url"):
        stop_local_redis(state["redis_url"], state.get("redis_pid"))
        if state.get("redis_dir"):  # its append-only file (for restarts while up) and log: one per random port
            shutil.rmtree(state["redis_dir"], ignore_errors=True)


def stop_local_redis(url: str, pid: int | None) -> None:
    """Stop the Redis ``up`` started: SHUTDOWN, or, when it does not answer (hung: paused, stuck),
    SIGKILL to the redis/valkey process of this machine serving its port."""
    try:
        stop_redis_at(url)
        return
    except (redis.exceptions.RedisError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    pid = server_process(urlparse(url).port, pid)
    print(f"the cluster's Redis does not answer ({error}); killing its process"
          f"{f' (pid {pid})' if pid else ': none serves its port'}", file=sys.stderr)
    if pid:
        os.kill(pid, signal.SIGKILL)
        wait_pid_gone(pid, 5.0)


def down(state_dir: Path | str | None = None) -> bool:
    """Stop what ``up`` started. Returns False when no cluster was up."""
    try:
        state = read_state(state_dir)
    except FileNotFoundError:
        return False
    try:
        check_ray_reachable(state["ray_address"])
        ray.init(address=state["ray_address"], namespace="pdcluster", logging_level="WARNING")
    except Exception as e:  # noqa: BLE001 - Ray already gone: nothing to kill there
        print(f"ray at {state.get('ray_address')} unreachable ({e}); skipping actor teardown", file=sys.stderr)
        state.pop("workers", None)
    _cleanup(state)
    state_path(state_dir).unlink(missing_ok=True)
    return True


def cmd_up(args) -> int:
    """``pdcluster up``; returns 0, 2 on a bad flag or model (found before anything started), or 1 when a
    cluster is already up from ``--state-dir``, ``--ray-address`` does not answer, Ray, Redis, a worker or
    the router failed to start, or the workers could not be placed or were not healthy within
    ``--timeout-s`` (everything ``up`` started stopped again); each a message on stderr (a worker's start
    error with its traceback)."""
    try:
        state = up(args)
    except (AlreadyUpError, ConnectionError, PlacementError, TimeoutError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError, ModelNotFoundError) as e:  # a bad flag or model, found before anything started
        print(f"pdcluster up: error: {e}", file=sys.stderr)
        return 2
    kinds = (f"{args.workers} colocated workers" if args.colocated
             else f"{args.prefill} prefill + {args.decode} decode workers")
    redis_at = state["redis_url"].rsplit("@", 1)[-1]  # without the password
    scheme = "https" if args.tls_cert else "http"
    http = f", OpenAI HTTP at {scheme}://{state['router_http_address']}/v1" if state.get("router_http_address") else ""
    routers = f"{args.routers} routers" if args.routers > 1 else "router"
    print(f"pdcluster is up: {routers} at {state['router_address']}{http} ({kinds}, redis {redis_at})")
    print(state["router_address"])
    return 0


def cmd_down(args) -> int:
    print("pdcluster is down" if down(args.state_dir) else "no pdcluster was up")
    return 0
