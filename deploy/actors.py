"""Ray actors hosting the router and the workers.

Each actor is one process: it builds its server in ``start()`` (so a failure is
reported to the caller of ``start``, with its traceback) and serves from its
own threads; the actor's method calls are only control (load, drain, stop, pid).

A worker binds its gRPC server to its Ray node's IP address (the address the
other nodes reach it at; ``127.0.0.1`` in a loopback-only local cluster).
"""

from __future__ import annotations

import gc
import os
from dataclasses import replace

import ray

from serving.worker_config import WorkerConfig


def _node_ip() -> str:
    return ray.util.get_node_ip_address()


@ray.remote(max_restarts=0)
class WorkerActor:
    """Hosts one prefill, decode or colocated worker."""

    def __init__(self, cfg: WorkerConfig) -> None:
        cfg.log.apply()
        self.cfg = cfg
        self.host = None

    def start(self) -> dict:
        """Load the model, start serving, register; returns ``{address, pid, node_id, node_ip}``."""
        node_id = ray.get_runtime_context().get_node_id()
        cfg = replace(self.cfg, host=_node_ip())
        if cfg.role == "prefill":
            from prefill_worker.worker import create_prefill_worker

            self.host = create_prefill_worker(cfg, node_id=node_id)
        elif cfg.role == "decode":
            from decode_worker.worker import create_decode_worker

            self.host = create_decode_worker(cfg, node_id=node_id)
        else:
            from colocated_worker.worker import create_colocated_worker

            self.host = create_colocated_worker(cfg, node_id=node_id)
        address = self.host.start()
        return {"address": address, "pid": os.getpid(), "node_id": node_id, "node_ip": cfg.host}

    def load(self) -> dict:
        return self.host.scheduler.load() if self.host else {}

    def drain(self, timeout_s: float) -> dict:
        """Stop taking new requests, finish the in-flight ones, deregister
        (:meth:`serving.worker_host.WorkerHost.drain`); returns its summary."""
        if self.host is None:
            idle = {"num_running": 0, "num_waiting": 0, "active_rpcs": 0}
            return {"drained": True, "waited_s": 0.0, **idle, "at_start": idle}
        return self.host.drain(timeout_s)

    def stop(self) -> None:
        if self.host:
            self.host.stop()
            self.host = None


@ray.remote(max_restarts=0)
class RouterActor:
    """Hosts the router (no torch compute; tokenizer and gRPC threads only).

    A router configured to listen on ``0.0.0.0`` reports its node's IP address.
    """

    def __init__(self, cfg) -> None:
        cfg.log.apply()
        self.cfg = cfg
        self.server = None

    def start(self) -> dict:
        from router.server import RouterServer

        self.server = RouterServer(self.cfg)
        address = self.server.start()
        # Everything made so far (imports, tokenizer, servers) lives as long as the process:
        # keep it out of the garbage collector's scans, so a full collection during a burst of
        # requests (refusals must take milliseconds) scans only the requests' own objects.
        gc.freeze()
        http = self.server.http_address
        if self.cfg.host == "0.0.0.0":
            address = f"{_node_ip()}:{self.server.port}"
            http = f"{_node_ip()}:{self.server.http.port}" if http else ""
        return {"address": address, "http_address": http, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def serving(self) -> bool:
        """Whether the router can serve requests now (its health service says SERVING)."""
        return self.server is not None and self.server.serving_now()[0]

    def stop(self) -> None:
        if self.server:
            self.server.stop()
            self.server = None
