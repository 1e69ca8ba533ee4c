"""Runs one worker: its scheduler loop thread, gRPC server, health, heartbeats and draining.

Role-specific code (``prefill_worker.worker`` / ``decode_worker.worker`` /
``colocated_worker.worker``) builds the scheduler and servicers; this module only
hosts them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Protocol

import grpc
from grpc_health.v1 import health_pb2_grpc
from redis.exceptions import AuthenticationError, RedisError

from serving.fd_room import make_fd_room
from serving.heartbeat import Heartbeater
from serving.registry import WorkerInfo, WorkerLoadSnapshot, WorkerRegistry
from serving.rpc import MAX_INTERNAL_CONNECTIONS, MarkHandlerStatus, add_health, pool_size, set_serving
from serving.security import Plane, bind, make_server
from serving.worker_config import WorkerConfig
from serving.worker_metrics import WorkerMetrics

if TYPE_CHECKING:  # the type only: importing the runner would load torch here
    from engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

_POLL_S = 0.05


KV_THREADS = 32
"""Threads of a decode worker's KV receiving server (one per transfer in flight)."""


class Scheduler(Protocol):
    def run(self, stop: threading.Event) -> None: ...
    def load(self) -> dict: ...


class ActiveRpcs(grpc.ServerInterceptor):
    """Counts the worker's own RPCs in progress (``pdcluster.v1`` methods except
    ``GetLoad``; health checks are not counted) and when the last one started.

    An RPC counts from the moment its handler is entered until it terminates
    (finished, failed or cancelled: gRPC's termination callback).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._last_start = 0.0

    def snapshot(self) -> tuple[int, float]:
        """``(RPCs in progress, time.monotonic() of the newest start; 0 if none yet)``."""
        with self._lock:
            return self._active, self._last_start

    def _started(self) -> None:
        with self._lock:
            self._active += 1
            self._last_start = time.monotonic()

    def _finished(self) -> None:
        with self._lock:
            self._active -= 1

    def _wrap(self, behavior):
        def counted(request_or_iterator, context):
            self._started()
            if not context.add_callback(self._finished):
                self._finished()  # already terminated
            return behavior(request_or_iterator, context)

        return counted

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith("/pdcluster.v1.") or method.endswith("/GetLoad"):
            return handler
        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        return handler._replace(**{kind: self._wrap(getattr(handler, kind))})


class WorkerHost:
    """Start/stop/drain a worker around its scheduler.

    Args:
        cfg: the worker's configuration.
        scheduler: object with ``run(stop_event)`` and ``load() -> dict``.
        add_servicers: ``f(server)`` attaching the role's servicers.
        services: full service names reported SERVING by the health service.
        port: gRPC port (0 = any free port).
        add_kv_servicers: ``f(server)`` attaching the KV receiver (decode and colocated
            workers: the registered transport's, :func:`kvtransfer.registry.attach_receiver`).
            It gets a server of its own on another port with its own thread
            pool (``KV_THREADS``), so long-lived ``Reserve`` streams holding every thread
            of the main server can never starve the transfers that would complete them.
        metrics: the worker's Prometheus metrics; their ``/metrics`` endpoint starts here
            (any free port) and its address is registered with the worker.
        on_stopped: called once the step loop has ended (e.g. the runner's ``close``).
        runner: the worker's model runner: :meth:`broken` asks it, and it calls :meth:`withdraw` the
            moment it breaks (its ``on_broken``), before the failing step's error leaves the worker.

    Both gRPC servers are internal-plane servers (:func:`serving.security.make_server`): with a
    cluster secret in ``cfg.security`` every call except health checks must carry it, and a
    call without it is refused before :class:`ActiveRpcs` or any handler sees it. Every status a
    handler sets is marked as the worker's own (:class:`serving.rpc.MarkHandlerStatus`), so the
    router's circuit breaker tells it from a transport failure.

    The main server's thread pool (a ``Reserve`` or ``Prefill`` holds a thread for its request's
    lifetime) is :func:`serving.rpc.pool_size` of ``max_num_seqs`` and ``max_queued_requests``
    (twice both on a colocated worker, whose requests hold one call of each).
    A decode or colocated worker refuses a ``Reserve`` beyond those two itself
    (:class:`decode_worker.server.DecodeWorkerServicer`) and its server refuses any call once
    every thread is busy, so no call waits unseen; a prefill worker's ``Prefill`` calls come only
    for requests a decode worker reserved, so their number is bounded there.
    """

    def __init__(self, cfg: WorkerConfig, scheduler: Scheduler,
                 add_servicers: Callable[[grpc.Server], None], services: list[str],
                 port: int = 0, add_kv_servicers: Callable[[grpc.Server], None] | None = None, block_size: int = 0,
                 num_total_blocks: int = 0, node_id: str = "", companions: list | None = None,
                 metrics: WorkerMetrics | None = None, on_stopped: Callable[[], None] | None = None,
                 runner: ModelRunner | None = None) -> None:
        self.cfg = cfg
        self.on_stopped = on_stopped  # after the step loop ended (e.g. stop the tensor-parallel ranks)
        self.runner = runner
        if runner is not None:
            runner.on_broken = lambda reason: self.withdraw()
        self.metrics = metrics
        self.scheduler = scheduler
        self.companions = companions or []  # objects with start()/stop() living as long as the server
        self._stop = threading.Event()
        self._draining = False
        self.rpcs = ActiveRpcs()
        calls = 2 if cfg.role == "colocated" else 1  # a colocated request holds a Reserve and a Prefill
        threads = pool_size(calls * cfg.scheduler.max_num_seqs, calls * cfg.max_queued_requests)
        make_fd_room(2 * MAX_INTERNAL_CONNECTIONS)  # its worker port and its KV port
        self.server = make_server(cfg.security, Plane.INTERNAL, max_workers=threads,
                                  interceptors=[self.rpcs, MarkHandlerStatus()], bounded=cfg.role != "prefill")
        self.health = add_health(self.server)
        add_servicers(self.server)
        self.port = bind(self.server, cfg.host, port, cfg.security, Plane.INTERNAL)
        self.address = f"{cfg.host}:{self.port}"
        self.kv_server, self.kv_address = None, ""
        if add_kv_servicers is not None:
            self.kv_server = make_server(cfg.security, Plane.INTERNAL, max_workers=KV_THREADS,
                                         interceptors=[self.rpcs, MarkHandlerStatus()])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.kv_server)
            add_kv_servicers(self.kv_server)
            self.kv_address = f"{cfg.host}:{bind(self.kv_server, cfg.host, 0, cfg.security, Plane.INTERNAL)}"
        self.services = services
        self.info = WorkerInfo(
            worker_id=cfg.worker_id, role=cfg.role, address=self.address,
            kv_endpoint=self.kv_address, node_id=node_id,
            model=cfg.model, block_size=block_size, num_total_blocks=num_total_blocks,
            started_at=time.time(), metrics_address=metrics.serve(cfg.host) if metrics is not None else "",
            pid=os.getpid(),
            max_num_seqs=cfg.scheduler.max_num_seqs if cfg.role != "prefill" else 0,
        )
        self.registry = WorkerRegistry(cfg.redis_url, cfg.cluster)
        # Liveness expires 1.5 heartbeat periods after the last beat (a dead worker is
        # dropped within 2); beats go out twice per period, so a beat delayed by up to a
        # whole period on a loaded machine does not drop a live worker.
        self.heartbeater = Heartbeater(self.registry, self.info, self._snapshot,
                                       period_s=cfg.heartbeat_s / 2, ttl_s=1.5 * cfg.heartbeat_s)
        self._loop = threading.Thread(target=scheduler.run, args=(self._stop,), daemon=True,
                                      name=f"{cfg.role}-scheduler")

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called (the router sends no new requests here)."""
        return self._draining

    def _snapshot(self) -> WorkerLoadSnapshot:
        load = self.scheduler.load()
        return WorkerLoadSnapshot(
            num_waiting=load["num_waiting"], num_running=load["num_running"],
            num_free_blocks=load["num_free_blocks"], num_total_blocks=load["num_total_blocks"],
            draining=self._draining,
        )

    def start(self) -> str:
        """Start serving and register; returns the gRPC address ``host:port``."""
        self._loop.start()
        if self.kv_server is not None:
            self.kv_server.start()
        self.server.start()
        set_serving(self.health, self.services)
        self._register()
        for c in self.companions:
            c.start()
        log.info("%s worker %s (generation %d) serving on %s", self.cfg.role, self.cfg.worker_id, self.info.generation,
                 self.address)
        return self.address

    def _register(self, wait_s: float = 30.0) -> None:
        """Take the next generation and start heartbeats, waiting out a Redis that does not answer for up
        to ``wait_s`` seconds (a local one the cluster controller is restarting: back within seconds).

        Raises:
            redis.exceptions.RedisError: Redis still unreachable after ``wait_s``, or (at once) it refused
                the password.
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.info = replace(self.info, generation=self.registry.next_generation(self.cfg.worker_id))
                self.heartbeater.info = self.info
                self.heartbeater.start()
                return
            except RedisError as e:
                if isinstance(e, AuthenticationError) or time.monotonic() > deadline:  # a wrong password: at once
                    raise
                log.warning("worker %s cannot register yet (Redis: %s); retrying", self.cfg.worker_id, e)
                time.sleep(0.5)

    def drain(self, timeout_s: float, settle_s: float | None = None) -> dict:
        """Take no new requests, finish every in-flight one, then deregister.

        1. The heartbeat carries ``draining=True`` from now on (one is sent at once),
           so the router's policies skip this worker; health turns NOT_SERVING for the
           router-facing service (KvTransfer stays SERVING: reservations made before
           still receive their KV).
        2. Waits until the scheduler holds no request (``num_running == num_waiting
           == 0``), no RPC of this worker is in progress, and none started during the
           last ``settle_s`` seconds (requests the router placed here before it saw the
           flag arrive within that). A prefill worker also waits until no decode
           worker has reservations waiting for blocks: each of them may still send its
           ``Prefill`` here.
        3. Deregisters (heartbeats stop). The server keeps answering until :meth:`stop`.

        Args:
            timeout_s: seconds to wait in step 2; on timeout the worker stays
                registered as draining and the summary says ``drained: False``.
            settle_s: quiet period in seconds; default twice the heartbeat period.

        Returns:
            ``{"drained": bool, "waited_s": float, "num_running": int, "num_waiting":
            int, "active_rpcs": int, "at_start": {...the same three counts when the
            drain began}}`` (the top-level counts are those when the wait ended).

        Raises:
            ValueError: ``timeout_s`` is not positive.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        settle_s = 2.0 * self.cfg.heartbeat_s if settle_s is None else settle_s
        t0 = time.monotonic()
        load, (active, _) = self.scheduler.load(), self.rpcs.snapshot()
        at_start = {"num_running": load["num_running"], "num_waiting": load["num_waiting"], "active_rpcs": active}
        self._draining = True
        self.heartbeater.beat()
        set_serving(self.health, [s for s in self.services if not s.endswith(".KvTransfer")], serving=False)
        log.info("%s worker %s draining", self.cfg.role, self.cfg.worker_id)
        drained = False
        while True:
            load = self.scheduler.load()
            active, last_start = self.rpcs.snapshot()
            now = time.monotonic()
            idle = (load["num_running"] == 0 and load["num_waiting"] == 0 and active == 0
                    and now - max(t0, last_start) >= settle_s and not self._decode_backlog())
            if idle:
                drained = True
                break
            if now - t0 >= timeout_s:
                log.warning("%s worker %s not drained after %.1fs: %s, %d RPCs in progress", self.cfg.role,
                            self.cfg.worker_id, timeout_s, load, active)
                break
            time.sleep(_POLL_S)
        if drained:
            self.heartbeater.stop(deregister=True)
            log.info("%s worker %s drained and deregistered", self.cfg.role, self.cfg.worker_id)
        return {"drained": drained, "waited_s": round(time.monotonic() - t0, 3), "num_running": load["num_running"],
                "num_waiting": load["num_waiting"], "active_rpcs": active, "at_start": at_start}

    def _decode_backlog(self) -> bool:
        """For a prefill worker: whether a live decode worker reports reservations waiting
        for blocks (unknown while Redis is unreachable: then False)."""
        if self.cfg.role != "prefill":
            return False
        try:
            return any(load.num_waiting for _, load in self.registry.live_workers("decode"))
        except Exception as e:  # noqa: BLE001 - Redis down: rely on the other conditions
            log.debug("registry read while draining failed: %s", e)
            return False

    def broken(self) -> str:
        """Why this worker can no longer serve, for good (``""`` while it can): what its runner says
        (:meth:`engine.model_runner.ModelRunner.broken`: a tensor-parallel rank gone or out of step).
        Its host process should then :meth:`leave` and end, to be started again
        (:class:`deploy.actors.WorkerActor`)."""
        return self.runner.broken() if self.runner is not None else ""

    def withdraw(self) -> None:
        """Take no more requests, for good: deregister (heartbeats stop) and health NOT_SERVING;
        idempotent, never raises (Redis down: logged). The runner calls it the moment it breaks, before
        the failing step's error reaches the router, so a request migrating off this worker finds it
        gone from the registry and is not placed here again."""
        self.heartbeater.stop(deregister=True)
        set_serving(self.health, self.services, serving=False)

    def leave(self) -> None:
        """Leave the cluster at once, for a worker that is :meth:`broken`: :meth:`withdraw`, then stop
        what ``on_stopped`` stops (the tensor-parallel ranks). The servers are left to the process's
        end, which the caller brings about: its open calls then fail as a crashed worker's do, and
        their requests migrate."""
        self.withdraw()
        if self.on_stopped is not None:
            self.on_stopped()

    def stop(self, grace_s: float = 1.0) -> None:
        """Deregister, stop the server and the loop."""
        for c in self.companions:
            c.stop()
        self.heartbeater.stop(deregister=True)
        set_serving(self.health, self.services, serving=False)
        self.server.stop(grace_s).wait()
        if self.kv_server is not None:
            self.kv_server.stop(grace_s).wait()
        self._stop.set()
        self._loop.join(timeout=5)
        if self.on_stopped is not None:
            self.on_stopped()
        if self.metrics is not None:
            self.metrics.stop()
