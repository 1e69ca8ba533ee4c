"""Keep a single-machine Ray cluster on loopback.

Ray resolves ``127.0.0.1`` to the machine's network address unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set before ``ray`` is imported; with it,
a local cluster's driver, head and workers talk over 127.0.0.1 only. Multi-node
clusters (``--ray-address`` of another host) must not set it. This module does
not import ray, so the CLI can call it before anything else does.

A local cluster also runs with Ray's token authentication (``RAY_AUTH_MODE=token``): its head, its
actors and every driver (``up``, ``scale``, ``down``) present the cluster's token
(``RAY_AUTH_TOKEN``), so another user of the machine cannot run code in the cluster through its
loopback ports. ``up`` takes the token this process already holds (an earlier ``up`` of the same
process: Ray caches a process' token; or the operator's ``$RAY_AUTH_TOKEN``), else a new one
(256 bits), and records it in the state file (mode 0600); ``scale`` and ``down`` read it from
there. The mode is set explicitly, as it must be: left unset, ``ray start --head`` turns token
authentication on whenever ``~/.ray/auth_token`` exists while a driver given the head's address
does not, and every driver would be refused. A cluster recorded without a token (started by an
older pdcluster) is reached with authentication off, as it runs.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from pathlib import Path

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
TOKEN_ENV = "RAY_AUTH_TOKEN"
STATE_TOKEN_KEY = "ray_auth_token"
NODE_ENV = {"RAY_worker_niceness": "0"}
"""Environment of every Ray node pdcluster starts (``ray start`` here and in the ``ray up`` YAMLs):
Ray starts its worker processes at nice 15 by default, which would put the router (an actor)
below every other process of its host; at 0 the router runs at normal priority and each pdcluster
worker lowers its own (:attr:`serving.worker_config.WorkerConfig.cpu_nice`)."""


def use_loopback_ray(state: dict | None = None) -> None:
    """Set the loopback flag and Ray's token authentication (see above) in this process and its
    children: the token of the local cluster recorded in ``state`` (its state file's contents),
    else the one this process holds, else a new one.

    Raises:
        RuntimeError: ``ray`` was imported already (the flag would be ignored).
    """
    if "ray" in sys.modules and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        raise RuntimeError("use_loopback_ray() must run before ray is imported")
    os.environ.update(LOOPBACK_ENV)
    if state is not None and not state.get(STATE_TOKEN_KEY):  # recorded before clusters had tokens
        os.environ["RAY_AUTH_MODE"] = "disabled"
        return
    os.environ[TOKEN_ENV] = (state or {}).get(STATE_TOKEN_KEY) or os.environ.get(TOKEN_ENV) or secrets.token_hex(32)


def ray_token() -> str | None:
    """The Ray token this process presents (:func:`use_loopback_ray`), if any."""
    return os.environ.get(TOKEN_ENV) if os.environ.get("RAY_AUTH_MODE") == "token" else None


def local_state(state_file: Path) -> dict | None:
    """The state recorded in ``state_file`` when ``up`` started its Ray head here, else ``None``."""
    try:
        state = json.loads(state_file.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return state if state.get("started_ray") else None


def check_ray_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast where ``ray.init`` would retry for minutes: a TCP connection to the Ray
    head's ``HOST:PORT`` (also ``ray://HOST:PORT``); other forms (``auto``) are left to Ray.

    Raises:
        ConnectionError: the address refuses or does not answer within ``timeout_s`` seconds.
    """
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"cannot reach the cluster's Ray at {address}: {e}") from None


def ray_answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether the Ray head at ``address`` accepts a connection within ``timeout_s`` seconds
    (:func:`check_ray_reachable`; an address it does not check counts as answering)."""
    try:
        check_ray_reachable(address, timeout_s)
    except ConnectionError:
        return False
    return True
