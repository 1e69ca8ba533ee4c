"""Ray actors hosting the router and the workers.

Each actor is one process: it builds its server in ``start()`` (so a failure is
reported to the caller of ``start``, with its traceback) and serves from its
own threads; the actor's method calls are only control (load, stop, pid).
"""

from __future__ import annotations

import logging
import os

import ray

from engine.config import WorkerConfig


@ray.remote(max_restarts=0)
class WorkerActor:
    """Hosts one prefill or decode worker."""

    def __init__(self, cfg: WorkerConfig) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.cfg = cfg
        self.host = None

    def start(self) -> dict:
        """Load the model, start serving, register; returns ``{address, pid, node_id}``."""
        node_id = ray.get_runtime_context().get_node_id()
        if self.cfg.role == "prefill":
            from prefill_worker.worker import create_prefill_worker

            self.host = create_prefill_worker(self.cfg, node_id=node_id)
        else:
            from decode_worker.worker import create_decode_worker

            self.host = create_decode_worker(self.cfg, node_id=node_id)
        address = self.host.start()
        return {"address": address, "pid": os.getpid(), "node_id": node_id}

    def load(self) -> dict:
        return self.host.scheduler.load() if self.host else {}

    def stop(self) -> None:
        if self.host:
            self.host.stop()
            self.host = None


@ray.remote(max_restarts=0)
class RouterActor:
    """Hosts the router (no torch compute; tokenizer and gRPC threads only)."""

    def __init__(self, cfg) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.cfg = cfg
        self.server = None

    def start(self) -> dict:
        from router.server import RouterServer

        self.server = RouterServer(self.cfg)
        return {"address": self.server.start(), "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def stop(self) -> None:
        if self.server:
            self.server.stop()
            self.server = None
