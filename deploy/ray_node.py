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


START_ATTEMPTS = 3
"""Heads started, each on newly drawn ports, before :func:`start_ray_head` gives up."""
_STARTED = "Ray runtime started"
"""What ``ray start`` logs once its runtime is up; ``--block`` checks its subprocesses a second later."""
_SUBPROCESS_DIED = "Some Ray subprocesses exited unexpectedly"
_MONITOR_PERIOD_S = 1.0
"""How often ``ray start --block`` checks its subprocesses (``ray/scripts/scripts.py``): one that died makes
it kill the rest."""


def start_ray_head(state_dir: Path, timeout_s: float = 120.0, resources: dict | None = None) -> tuple[str, int]:
    """Start a Ray head on loopback (``ray start --head --block`` in its own session, so it can
    be stopped exactly with :func:`stop_ray_head`). Returns ``(address, pid)``.

    A head counts as started once ``ray start`` has passed its first check of its subprocesses
    (about a second after ``Ray runtime started``). A port drawn free can be taken before the
    component meant for it binds it (seen in the test suite: the Ray client server's, ``Address
    already in use``); that component exits, ``ray start --block`` then kills the whole head, and a
    caller already connected would wait on a dead GCS for good. Such a head is started again on
    newly drawn ports, up to :data:`START_ATTEMPTS` times.

    Args:
        state_dir: folder for the head's log (``ray-head.log``, the last attempt's).
        timeout_s: seconds to wait for each attempt's start.
        resources: what the head advertises (see :func:`ray_start_flags`); by default
            what Ray detects.

    Raises:
        ValueError: bad ``resources``.
        RuntimeError: the head exited or did not start within ``timeout_s`` in every attempt (with
            the last one's log).
    """
    flags = ray_start_flags(resources)
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start_head_once(state_dir, timeout_s, flags)
        except _HeadExited as e:
            if attempt == START_ATTEMPTS:
                raise RuntimeError(f"the Ray head failed to start {START_ATTEMPTS} times; the last time: {e}") from None
            print(f"the Ray head exited while starting ({e.args[0].splitlines()[0]}); starting it again on other "
                  "ports", file=sys.stderr)
    raise AssertionError("unreachable")


class _HeadExited(RuntimeError):
    """``ray start`` exited, or one of its subprocesses died, while the head started."""


def _start_head_once(state_dir: Path, timeout_s: float, flags: list[str]) -> tuple[str, int]:
    gcs_port, client_port, agent_port = ray_node_ports()
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    # the Ray client server on a free port: on its default (10001) two local clusters would both
    # listen with SO_REUSEPORT and a ray:// client would reach either; the dashboard agent's too:
    # its default (52365) lies in the range free ports are drawn from
    cmd = [ray_bin, "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1", *flags, "--head",
           f"--port={gcs_port}", "--include-dashboard=false", f"--ray-client-server-port={client_port}",
           f"--dashboard-agent-listen-port={agent_port}"]
    log_path = state_dir / "ray-head.log"
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **LOOPBACK_ENV, **NODE_ENV})
    deadline, checked_at = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        log = log_path.read_text()
        if proc.poll() is not None or _SUBPROCESS_DIED in log:
            rc = proc.poll()
            stop_ray_head(proc.pid, timeout_s=2.0)
            what = f"exited with {rc}" if rc is not None else "saw one of its subprocesses exit"
            raise _HeadExited(f"`{' '.join(cmd)}` {what}:\n{log_path.read_text()[-3000:]}")
        if checked_at is None and _STARTED in log:
            checked_at = time.monotonic() + _MONITOR_PERIOD_S + 0.3  # past its first check
        if checked_at is not None and time.monotonic() >= checked_at:
            return f"127.0.0.1:{gcs_port}", proc.pid
        time.sleep(0.1)
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
