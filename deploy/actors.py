"""Ray actors hosting the router and the workers.

Each actor is one process, restarted by Ray when it dies (``max_restarts=-1``: a crash,
``kill -9``, its node leaving — Ray re-places the actor in its placement-group bundle, which
Ray itself moves to a remaining node). A worker actor starts its server from ``__init__`` on
a background thread, so a restarted actor comes back serving with no caller: it loads the
model, binds new ports and registers under the next generation
(:meth:`serving.registry.WorkerRegistry.next_generation`). ``start()`` waits for that and
reports its address or its failure (with traceback); ``status()`` answers at once
(``loading`` / ``serving`` / ``failed``), which is how the cluster controller
(:mod:`deploy.controller`) tells a loading worker from a hung one. The actors' methods are
only control (status, load, drain, stop); requests go to the gRPC servers.

A worker binds its gRPC server to its Ray node's IP address (the address the other nodes
reach it at; ``127.0.0.1`` in a loopback-only local cluster). A router restarts on the
ports the cluster's first router bound (kept in Redis by :mod:`deploy.router_ports`), so
clients reconnect to the same address; ``pdcluster up --routers N`` runs N router actors
sharing those ports.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import traceback
import warnings
from dataclasses import replace

import ray

from serving.priority import lower_cpu_priority
from serving.worker_config import WorkerConfig

log = logging.getLogger(__name__)
RESTARTS = -1  # Ray restarts a dead actor without limit; the controller bounds restart storms


def was_restarted() -> bool:
    """Whether this actor process is a restart of one that died (Ray's reconstruction)."""
    with warnings.catch_warnings():  # Ray's own property trips its deprecation warning
        warnings.simplefilter("ignore", DeprecationWarning)
        return ray.get_runtime_context().was_current_actor_reconstructed


def _node_ip() -> str:
    return ray.util.get_node_ip_address()


def _create_host(cfg: WorkerConfig, node_id: str):
    if cfg.role == "prefill":
        from prefill_worker.worker import create_prefill_worker

        return create_prefill_worker(cfg, node_id=node_id)
    if cfg.role == "decode":
        from decode_worker.worker import create_decode_worker

        return create_decode_worker(cfg, node_id=node_id)
    from colocated_worker.worker import create_colocated_worker

    return create_colocated_worker(cfg, node_id=node_id)


@ray.remote(max_restarts=RESTARTS, max_task_retries=0, max_concurrency=4)
class WorkerActor:
    """Hosts one prefill, decode or colocated worker; starts it on construction."""

    def __init__(self, cfg: WorkerConfig) -> None:
        cfg.log.apply()
        lower_cpu_priority(cfg.cpu_nice)  # before its threads start: they inherit it
        self.cfg = cfg
        self.host = None
        self.phase = "loading"
        self.error = ""
        self.info: dict = {}
        self.restarted = was_restarted()
        self._ready = threading.Event()
        threading.Thread(target=self._start, name="worker-start", daemon=True).start()

    def _start(self) -> None:
        node_id = ray.get_runtime_context().get_node_id()
        cfg = replace(self.cfg, host=_node_ip())
        try:
            self.host = _create_host(cfg, node_id)
            address = self.host.start()
            self.info = {"address": address, "pid": os.getpid(), "node_id": node_id, "node_ip": cfg.host,
                         "generation": self.host.info.generation}
            self.phase = "serving"
            if self.restarted:
                log.warning("worker %s restarted after a crash: serving again on %s (generation %d)",
                            cfg.worker_id, address, self.host.info.generation)
            threading.Thread(target=self._watch_engine, name="engine-watch", daemon=True).start()
        except BaseException:  # noqa: BLE001 - reported by start() / status()
            self.error = traceback.format_exc()
            self.phase = "failed"
            log.error("worker %s failed to start:\n%s", cfg.worker_id, self.error)
        finally:
            self._ready.set()

    def _watch_engine(self) -> None:
        """Every heartbeat period, whether the worker can still run steps
        (:meth:`serving.worker_host.WorkerHost.broken`: a tensor-parallel rank gone). One that cannot
        would fail every request sent to it while it kept beating, so it leaves the registry and ends
        this process: Ray starts the actor again, with new ranks, and its open requests migrate as a
        crashed worker's do."""
        while True:
            time.sleep(self.cfg.heartbeat_s)
            host = self.host
            if host is None:  # stopped
                return
            reason = host.broken()
            if reason:
                log.error("worker %s cannot run steps any more (%s): leaving the registry and exiting, "
                          "so that it is started again", self.cfg.worker_id, reason)
                host.leave()
                logging.shutdown()
                os._exit(1)

    def start(self, timeout_s: float | None = None) -> dict:
        """Wait until the worker serves; returns ``{address, pid, node_id, node_ip, generation}``.

        Raises:
            RuntimeError: it failed to start (with the traceback), or did not within ``timeout_s``.
        """
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"worker {self.cfg.worker_id} did not start within {timeout_s}s")
        if self.phase != "serving":
            raise RuntimeError(f"worker {self.cfg.worker_id} failed to start:\n{self.error}")
        return self.info

    def status(self) -> dict:
        """``{phase, error, restarted, pid}`` now (never waits for the model to load)."""
        return {"phase": self.phase, "error": self.error[-2000:], "restarted": self.restarted, "pid": os.getpid()}

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


@ray.remote(max_restarts=RESTARTS, max_task_retries=0, max_concurrency=4)
class RouterActor:
    """Hosts one router (no torch compute; tokenizer and gRPC threads only).

    A router configured to listen on ``0.0.0.0`` reports its node's IP address. The first
    router of a cluster is started by :meth:`start` and records the ports it bound in Redis;
    every other one (``follow``: the cluster's routers 1 .. N-1, or one the controller
    recreates) and every router Ray reconstructs after a crash starts on its own, on the
    recorded ports (read from Redis, waiting for Redis if it is down too), shared with the
    others through SO_REUSEPORT when the cluster has several. Its view of the workers, their
    load and the other routers is rebuilt from the registry, which is all the state a router has.
    :meth:`started` waits until a router that starts on its own serves.
    """

    def __init__(self, cfg, follow: bool = False) -> None:
        cfg.log.apply()
        if (nice := os.getpriority(os.PRIO_PROCESS, 0)) > 0:
            log.warning("the router runs at nice %d (Ray's RAY_worker_niceness): on shared cores the workers "
                        "compete with it as equals; start the Ray nodes with RAY_worker_niceness=0", nice)
        self.cfg = cfg
        self.server = None
        self.result: dict = {}
        self.error = ""
        self._ready = threading.Event()
        self.restarted = was_restarted()
        if self.restarted or follow:
            threading.Thread(target=self._follow, name="router-start", daemon=True).start()

    def _follow(self) -> None:
        from deploy.router_ports import wait_router_ports

        try:
            ports = wait_router_ports(self.cfg.redis_url, self.cfg.cluster)
            self.cfg = replace(self.cfg, port=ports["port"],
                               http_port=ports["http_port"] if self.cfg.http_port is not None else None)
            self.start()
        except BaseException:  # noqa: BLE001 - reported by started()
            self.error = traceback.format_exc()
            log.error("router-%d failed to start:\n%s", self.cfg.index, self.error)
            self._ready.set()
            return
        if self.restarted:
            log.warning("router-%d restarted after a crash: serving again on %s", self.cfg.index,
                        self.result["address"])

    def start(self) -> dict:
        """Build and start the servers; returns ``{address, http_address, pid, node_id, index}``."""
        from deploy.router_ports import save_router_ports
        from router.server import RouterServer

        if self.cfg.host == "0.0.0.0":
            self.cfg = replace(self.cfg, advertise_host=_node_ip())
        self.server = RouterServer(self.cfg)
        address = self.server.start()
        # Everything made so far (imports, tokenizer, servers) lives as long as the process:
        # keep it out of the garbage collector's scans, so a full collection during a burst of
        # requests (refusals must take milliseconds) scans only the requests' own objects.
        gc.freeze()
        http = self.server.http_address
        save_router_ports(self.cfg.redis_url, self.cfg.cluster, self.server.port,
                          self.server.http.port if self.server.http else None)
        if self.cfg.host == "0.0.0.0":
            address = f"{_node_ip()}:{self.server.port}"
            http = f"{_node_ip()}:{self.server.http.port}" if http else ""
        self.result = {"address": address, "http_address": http, "pid": os.getpid(), "index": self.cfg.index,
                       "metrics_address": self.server.metrics_address,
                       "node_id": ray.get_runtime_context().get_node_id()}
        self._ready.set()
        return self.result

    def started(self, timeout_s: float | None = None) -> dict:
        """Wait until a router that starts on its own serves; returns what :meth:`start` returns.

        Raises:
            RuntimeError: it failed to start (with the traceback), or did not within ``timeout_s``.
        """
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"router-{self.cfg.index} did not start within {timeout_s}s")
        if not self.result:
            raise RuntimeError(f"router-{self.cfg.index} failed to start:\n{self.error}")
        return self.result

    def status(self) -> dict:
        """``{phase, error, serving, pid, address, index}`` now; ``phase`` as a worker's
        (``loading`` until its servers started, ``serving``, ``failed`` with ``error``), so the
        cluster controller probes a router as it probes a worker."""
        phase = "serving" if self.result else "failed" if self.error else "loading"
        return {"phase": phase, "error": self.error[-2000:], "serving": self.serving(), "pid": os.getpid(),
                "address": self.result.get("address", ""), "index": self.cfg.index}

    def serving(self) -> bool:
        """Whether the router can serve requests now (its health service says SERVING)."""
        return self.server is not None and self.server.serving_now()[0]

    def stop(self) -> None:
        if self.server:
            self.server.stop()
            self.server = None
