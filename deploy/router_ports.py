"""The router's ports, kept in the registry's Redis so that a restarted router actor binds
the same ones (clients keep their address)."""

from __future__ import annotations

import logging
import time

from redis.exceptions import RedisError

from serving.registry import WorkerRegistry

log = logging.getLogger(__name__)
KEY = "router-ports"


def save_router_ports(redis_url: str, cluster: str, port: int, http_port: int | None) -> None:
    """Record the ports the router bound (``http_port`` ``None``: no HTTP server).

    Raises:
        redis.exceptions.RedisError: Redis unreachable.
    """
    reg = WorkerRegistry(redis_url, cluster)
    try:
        reg.put_state(KEY, {"port": port, "http_port": http_port})
    finally:
        reg.close()


def wait_router_ports(redis_url: str, cluster: str, poll_s: float = 1.0) -> dict:
    """The recorded ports ``{port, http_port}``; waits (without limit: a restarting router
    has nothing else to do) while Redis is down. ``{port: 0, http_port: 0}`` when none
    were recorded (a router that never started)."""
    reg = WorkerRegistry(redis_url, cluster)
    warned = False
    try:
        while True:
            try:
                return reg.get_state(KEY) or {"port": 0, "http_port": 0}
            except RedisError as e:
                if not warned:
                    log.warning("restarting router waits for Redis to learn its ports: %s", e)
                    warned = True
                time.sleep(poll_s)
    finally:
        reg.close()
