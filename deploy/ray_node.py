"""The Ray head of a local cluster (``up --local``): ``ray start --head`` on loopback in its own
session (so ``down`` stops exactly it), on ports drawn free and kept apart from Ray's defaults."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from deploy.ray_env import LOOPBACK_ENV, NODE_ENV
from deploy.redis_server import free_port


def ray_start_flags(resources: dict | None) -> list[str]:
    """``ray start`` flags advertising ``resources`` (``CPU`` / ``GPU`` become ``--num-cpus`` /
    ``--num-gpus``, the rest goes to ``--resources``).

    Raises:
        ValueError: a quantity that is not a non-negative whole number (Ray's rule for
            what a node advertises).
    """
    flags, custom = [], {}
    for key, value in (resources or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
            raise ValueError(f"Ray resource {key!r} must be a non-negative whole number, got {value!r}")
        if key in ("CPU", "GPU"):
            flags.append(f"--num-{key.lower()}s={int(value)}")
        else:
            custom[key] = int(value)
    if custom:
        flags.append("--resources=" + json.dumps(custom))
    return flags


# ports Ray gives its components by default (dashboard, dashboard agent HTTP, client server, GCS)
RAY_DEFAULT_PORTS = frozenset({8265, 52365, 10001, 6379})


def ray_node_ports(count: int = 3) -> list[int]:
    """``count`` distinct ports free on loopback a moment ago, none of them a port Ray gives one of
    its components by default (:data:`RAY_DEFAULT_PORTS`): ``ray start`` refuses two components on
    one port (seen in CI: the client server drawn on 52365, the dashboard agent's default)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports and port not in RAY_DEFAULT_PORTS:
            ports.append(port)
    return ports


def start_ray_head(state_dir: Path, timeout_s: float = 120.0, resources: dict | None = None) -> tuple[str, int]:
    """Start a Ray head on loopback (``ray start --head --block`` in its own session, so it can
    be stopped exactly with :func:`stop_ray_head`). Returns ``(address, pid)``.

    Args:
        state_dir: folder for the head's log (``ray-head.log``).
        timeout_s: seconds to wait for ``Ray runtime started``.
        resources: what the head advertises (see :func:`ray_start_flags`); by default
            what Ray detects.

    Raises:
        ValueError: bad ``resources``.
        RuntimeError: the head exited or did not start within ``timeout_s`` (with its log).
    """
    gcs_port, client_port, agent_port = ray_node_ports()
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    # the Ray client server on a free port: on its default (10001) two local clusters would both
    # listen with SO_REUSEPORT and a ray:// client would reach either; the dashboard agent's too:
    # its default (52365) lies in the range free ports are drawn from
    cmd = [ray_bin, "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
           *ray_start_flags(resources), "--head", f"--port={gcs_port}", "--include-dashboard=false",
           f"--ray-client-server-port={client_port}", f"--dashboard-agent-listen-port={agent_port}"]
    log_path = state_dir / "ray-head.log"
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **LOOPBACK_ENV, **NODE_ENV})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        if "Ray runtime started" in log_path.read_text():
            return f"127.0.0.1:{gcs_port}", proc.pid
        time.sleep(0.2)
    stop_ray_head(proc.pid)
    raise RuntimeError(f"Ray head did not start within {timeout_s:.0f}s; see {log_path}")


def stop_ray_head(pid: int, timeout_s: float = 10.0) -> None:
    """Stop a Ray head started by :func:`start_ray_head` and every process of its session
    (SIGTERM, then SIGKILL after ``timeout_s`` seconds: the raylet stops its workers and exits
    within about 10 s of SIGTERM, but ``ray start --block`` and the GCS linger until killed;
    once the cluster's actors are killed, a short ``timeout_s`` loses nothing)."""
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
