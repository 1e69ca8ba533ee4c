"""Runs one worker: its scheduler loop thread, gRPC server, health and heartbeats.

Role-specific code (``prefill_worker.worker`` / ``decode_worker.worker``) builds the
scheduler and servicers; this module only hosts them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol

import grpc

from engine.config import WorkerConfig
from pdcluster.registry import Heartbeater, WorkerInfo, WorkerLoadSnapshot, WorkerRegistry
from pdcluster.serving import bind, make_server, set_serving

log = logging.getLogger(__name__)


class Scheduler(Protocol):
    def run(self, stop: threading.Event) -> None: ...
    def load(self) -> dict: ...


class WorkerHost:
    """Start/stop a worker around its scheduler.

    Args:
        cfg: the worker's configuration.
        scheduler: object with ``run(stop_event)`` and ``load() -> dict``.
        add_servicers: ``f(server)`` attaching the role's servicers.
        services: full service names reported SERVING by the health service.
        port: gRPC port (0 = any free port).
    """

    def __init__(self, cfg: WorkerConfig, scheduler: Scheduler,
                 add_servicers: Callable[[grpc.Server], None], services: list[str],
                 port: int = 0, kv_endpoint_same_port: bool = False, block_size: int = 0,
                 num_total_blocks: int = 0, node_id: str = "") -> None:
        self.cfg = cfg
        self.scheduler = scheduler
        self._stop = threading.Event()
        self.server, self.health = make_server()
        add_servicers(self.server)
        self.port = bind(self.server, cfg.host, port)
        self.address = f"{cfg.host}:{self.port}"
        self.services = services
        self.info = WorkerInfo(
            worker_id=cfg.worker_id, role=cfg.role, address=self.address,
            kv_endpoint=self.address if kv_endpoint_same_port else "", node_id=node_id,
            model=cfg.model, block_size=block_size, num_total_blocks=num_total_blocks,
            started_at=time.time(),
        )
        self.registry = WorkerRegistry(cfg.redis_url, cfg.cluster)
        self.heartbeater = Heartbeater(self.registry, self.info, self._snapshot,
                                       period_s=cfg.heartbeat_s, ttl_s=1.5 * cfg.heartbeat_s)
        self._loop = threading.Thread(target=scheduler.run, args=(self._stop,), daemon=True,
                                      name=f"{cfg.role}-scheduler")

    def _snapshot(self) -> WorkerLoadSnapshot:
        load = self.scheduler.load()
        return WorkerLoadSnapshot(
            num_waiting=load["num_waiting"], num_running=load["num_running"],
            num_free_blocks=load["num_free_blocks"], num_total_blocks=load["num_total_blocks"],
        )

    def start(self) -> str:
        """Start serving and register; returns the gRPC address ``host:port``."""
        self._loop.start()
        self.server.start()
        set_serving(self.health, self.services)
        self.heartbeater.start()
        log.info("%s worker %s serving on %s", self.cfg.role, self.cfg.worker_id, self.address)
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        """Deregister, stop the server and the loop."""
        self.heartbeater.stop(deregister=True)
        set_serving(self.health, self.services, serving=False)
        self.server.stop(grace_s).wait()
        self._stop.set()
        self._loop.join(timeout=5)
