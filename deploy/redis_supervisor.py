"""Keeping a local cluster's Redis up: restart it on the same port, password and folder.

The server ``pdcluster up`` starts keeps an append-only file (``persist``), so a restarted
one comes back with the registry, the desired state and the workers' generation counters;
workers re-register within two heartbeats anyway (:class:`serving.heartbeat.Heartbeater`),
and the router serves from its last view meanwhile (:class:`serving.discovery.RegistryView`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from deploy.redis_control import is_answering
from deploy.redis_server import LocalRedisServer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RedisSpec:
    """How the cluster's Redis was started: its URL (host, port, password) and folder."""

    url: str
    workdir: str

    def server(self) -> LocalRedisServer:
        u = urlparse(self.url)
        return LocalRedisServer(Path(self.workdir), port=u.port, host=u.hostname or "127.0.0.1", detach=True,
                                password=u.password or None, persist=True)


class RedisSupervisor:
    """Restarts the Redis of ``spec`` after ``down_checks`` consecutive failed PINGs.

    Attributes:
        restarts: how many times it restarted the server.
    """

    def __init__(self, spec: RedisSpec, down_checks: int = 2) -> None:
        self.spec = spec
        self.down_checks = down_checks
        self._failed = 0
        self.restarts = 0

    def check(self) -> bool:
        """PING once; restart the server when it has not answered ``down_checks`` times in a
        row. Returns whether Redis answers now (after any restart). Never raises."""
        if is_answering(self.spec.url, timeout_s=0.5):
            self._failed = 0
            return True
        self._failed += 1
        if self._failed < self.down_checks:
            return False
        log.warning("cluster Redis at %s does not answer (%d PINGs): restarting it", _where(self.spec.url),
                    self._failed)
        try:
            server = self.spec.server().start()
        except (RuntimeError, OSError) as e:
            log.error("restarting Redis failed: %s", e)
            return False
        self._failed = 0
        self.restarts += 1
        log.warning("cluster Redis restarted (pid %s) on %s", server.pid, _where(self.spec.url))
        return True


def _where(url: str) -> str:
    return url.rsplit("@", 1)[-1]
