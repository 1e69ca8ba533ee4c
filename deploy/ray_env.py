"""Keep a single-machine Ray cluster on loopback.

Ray resolves ``127.0.0.1`` to the machine's network address unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set before ``ray`` is imported; with it,
a local cluster's driver, head and workers talk over 127.0.0.1 only. Multi-node
clusters (``--ray-address`` of another host) must not set it. This module does
not import ray, so the CLI can call it before anything else does.

A local cluster also runs with ``RAY_AUTH_MODE=disabled`` in its head and drivers alike: left unset,
``ray start --head`` turns Ray's token authentication on whenever ``~/.ray/auth_token`` exists
(a plain ``ray.init()`` writes one) while a driver given the head's address does not, and every
driver would then be refused (``InvalidAuthToken``). The head listens on loopback only.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
NODE_ENV = {"RAY_worker_niceness": "0"}
"""Environment of every Ray node pdcluster starts (``ray start`` here and in the ``ray up`` YAMLs):
Ray starts its worker processes at nice 15 by default, which would put the router (an actor)
below every other process of its host; at 0 the router runs at normal priority and each pdcluster
worker lowers its own (:attr:`serving.worker_config.WorkerConfig.cpu_nice`)."""


def use_loopback_ray() -> None:
    """Set the loopback flag (and Ray's auth mode, see above) in this process and its children.

    Raises:
        RuntimeError: ``ray`` was imported already (the flag would be ignored).
    """
    if "ray" in sys.modules and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        raise RuntimeError("use_loopback_ray() must run before ray is imported")
    os.environ.update(LOOPBACK_ENV)


def state_is_local(state_file: Path) -> bool:
    """Whether the cluster recorded in ``state_file`` runs a Ray head that ``up`` started here."""
    try:
        return bool(json.loads(state_file.read_text()).get("started_ray"))
    except (FileNotFoundError, ValueError):
        return False


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
