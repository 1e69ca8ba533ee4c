"""Build and run the router process: tokenizer, registry view, the request path
(:mod:`router.core`) behind two front doors, gRPC (``Router`` + health + reflection) and
OpenAI-compatible HTTP (:mod:`router.openai.app`, with ``/metrics`` and Prometheus service
discovery). Health is SERVING only while a live prefill and a live decode worker (or a
colocated worker) exist. With API keys (``RouterConfig.security``) both front doors refuse
callers without one (health exempt: :mod:`serving.security`, :mod:`router.openai.auth`), and
every call to a worker carries the cluster secret.

Every queue is explicit: admission (:mod:`router.admission`) bounds the requests the router
holds, the gRPC pool has a thread for each of them plus spare ones for fast refusals, and a
call beyond the pool is refused at once (never queued). The router's channels to the workers
report every call's end to the circuit breaker (:mod:`router.breaker`) and every ``Prefill``
to the prefill-rate meter (:mod:`router.watch`), and ping their workers (keepalive) so a worker
that stopped answering fails its calls instead of holding them.

Several routers may serve one cluster behind one address (``pdcluster up --routers N``): with
``RouterConfig.reuse_port`` the public gRPC and HTTP ports are bound with SO_REUSEPORT and the
kernel spreads connections over the routers. A scrape of the shared HTTP port reaches any one of
them, so each router also serves its own ``/metrics`` on a private port and publishes a record
in Redis (:mod:`router.peers`); service discovery lists every live router's private port, and
admission divides the cluster's capacity by the live routers."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import threading
import time
from functools import partial

from grpc_reflection.v1alpha import reflection

from common.model_config import ModelConfig
from common.tokenizer import load_tokenizer
from pdcluster.v1 import router_pb2
from router.admission import Admission
from router.breaker import CircuitBreaker
from router.cache_aware import cached_prefix_tokens
from router.core import RequestRouter
from router.fleet import FleetGauges
from router.grpc_answers import GrpcReading
from router.http import HttpServer
from router.config import RouterConfig
from router.limits import Limits
from router.load import LoadTracker, PrefillRates
from router.openai.app import FrontDoorState, build_app
from router.peers import RouterPeers
from router.placement import POLICIES, Placer, make_policy
from router.policy import Signals
from router.service import RouterServicer, add_router_service
from router.start_lane import ArrivalPool, StartLane
from router.stubs import StubCache
from router.validation import RequestValidator, prompt_byte_cap
from router.watch import health_probe, watched_channel
from serving.cache_index import CacheIndexView
from serving.discovery import RegistryView
from serving.fd_room import make_fd_room
from serving.metrics import ProcessMetrics
from serving.metrics_http import MetricsHttpServer
from serving.registry import RouterRecord, WorkerInfo, WorkerRegistry
from serving.rpc import GRPC_OPTIONS, SPARE_THREADS, add_health, keepalive_options, receive_limit, set_serving
from serving.security import Plane, bind, internal_channel, make_server

log = logging.getLogger(__name__)
SERVICE = "pdcluster.v1.Router"
PEER_PERIODS = 4
"""A router refreshes its record for the other routers, and its fleet gauges
(:mod:`router.fleet`), every ``PEER_PERIODS`` view periods (``pdcluster up`` sets the view
period to a quarter of the heartbeat: once per heartbeat)."""


def _tokenizer(cfg: RouterConfig):
    """The served model's tokenizer, with ``cfg.chat_template`` (``up --chat-template``) as its template."""
    tokenizer = load_tokenizer(cfg.model_path)
    if cfg.chat_template is not None:
        tokenizer.chat_template = cfg.chat_template
    return tokenizer


class RouterServer:
    """The router process' servers. ``start()`` returns the gRPC ``host:port``; the HTTP
    port (when enabled) is ``http_address`` after ``start()``."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        model_cfg = ModelConfig.from_hf_folder(cfg.model_path, name=cfg.model)
        max_len = min(cfg.max_model_len, model_cfg.context_len)
        tokenizer = _tokenizer(cfg)
        self.view = RegistryView(WorkerRegistry(cfg.redis_url, cfg.cluster), period_s=cfg.view_period_s)
        info = router_pb2.ModelInfo(model_name=cfg.model, max_model_len=max_len, vocab_size=model_cfg.vocab_size,
                                    eos_token_ids=list(model_cfg.eos_token_ids), block_size=cfg.block_size)
        self.cache_index = CacheIndexView(
            cfg.redis_url, cfg.cluster, lambda: [w.worker_id for w, _ in self.view.workers("prefill")],
            period_s=cfg.view_period_s) if POLICIES[cfg.policy].needs_cache_index else None
        load = LoadTracker()
        policy = make_policy(cfg.policy, Signals(load, self.cache_index))
        self.router_id = f"router-{cfg.index}"
        self.metrics = ProcessMetrics("router", self.router_id, cfg.model)
        prompt_bytes = cfg.max_prompt_bytes or prompt_byte_cap(tokenizer, max_len)
        connect = partial(internal_channel, cfg.security,
                          options=GRPC_OPTIONS + keepalive_options(cfg.breaker.ping_s))
        self.breaker = CircuitBreaker(cfg.breaker, health_probe(connect, cfg.breaker.probe_timeout_s), self.metrics)
        self.prefill_rates = PrefillRates()
        self.peers = RouterPeers(WorkerRegistry(cfg.redis_url, cfg.cluster), self._record,
                                 period_s=cfg.view_period_s * PEER_PERIODS)
        self.fleet = FleetGauges(self.metrics, lambda: [info for info, _ in self.view.workers()],
                                 WorkerRegistry(cfg.redis_url, cfg.cluster))
        self.admission = Admission(cfg.admission, partial(self._takers, "decode"), partial(self._takers, "prefill"),
                                   load, self.prefill_rates, self._cached_tokens, self.metrics, self.peers.count)
        lane = StartLane()
        threads = cfg.admission.max_admitted_requests + SPARE_THREADS
        self.core = RequestRouter(
            RequestValidator(tokenizer, Limits(max_len, model_cfg.vocab_size, max_prompt_bytes=prompt_bytes),
                             cfg.reasoning_parser),
            tokenizer, Placer(self.view, policy, self.breaker), load, self.metrics,
            StubCache(lambda address: watched_channel(connect(address), address, self.breaker, self.prefill_rates)),
            self.admission, max_migrations=cfg.max_migrations, lane=lane)
        self.servicer = RouterServicer(self.core, info, GrpcReading(cfg.tool_call_parser, cfg.reasoning_parser,
                                                                    tokenizer))
        self.server = make_server(cfg.security, Plane.PUBLIC,
                                  max_workers=threads, pool=ArrivalPool(threads, lane),
                                  options=[(k, int(cfg.reuse_port) if k == "grpc.so_reuseport" else v)
                                           for k, v in receive_limit(cfg.max_request_bytes)], bounded=True,
                                  max_connections=cfg.grpc_max_connections)
        self.health = add_health(self.server)
        add_router_service(self.servicer, self.server)
        reflection.enable_server_reflection(
            (router_pb2.DESCRIPTOR.services_by_name["Router"].full_name, reflection.SERVICE_NAME,
             "grpc.health.v1.Health"), self.server)
        self.port = bind(self.server, cfg.host, cfg.port, cfg.security, Plane.PUBLIC)
        self.address = f"{cfg.host}:{self.port}"
        tls = (cfg.security.tls_cert.encode(), cfg.security.tls_key.encode()) if cfg.security.public_tls else None
        make_fd_room(cfg.port_connections)
        self.metrics_http = MetricsHttpServer(self.metrics.registry, cfg.host,
                                              cfg.security.accepts_api_key if cfg.security.api_keys else None, tls)
        self.metrics_address = f"{cfg.advertise_host or cfg.host}:{self.metrics_http.port}"
        self.started_at = 0.0
        self.http_address = ""
        self.http = None if cfg.http_port is None else self._http_server(tokenizer, max_len, info.eos_token_ids, tls)
        self._stop = threading.Event()
        self._health_thread = threading.Thread(target=self._watch_health, name="router-health", daemon=True)

    def _http_server(self, tokenizer, max_len: int, eos_token_ids, tls) -> HttpServer:
        """The OpenAI-compatible HTTP server (:mod:`router.openai.app`) on ``cfg.http_port``."""
        cfg = self.cfg
        return HttpServer(build_app(FrontDoorState(
            self.core, cfg.model, tokenizer, self.serving_now, self.scrape_targets, self.metrics.registry,
            cfg.security.accepts_api_key, int(time.time()), max_len, cfg.max_request_bytes,
            cfg.http_body_timeout_s, self.metrics, cfg.allowed_origins, cfg.tool_call_parser,
            frozenset(eos_token_ids), cfg.reasoning_parser)), cfg.host,
            cfg.http_port, tls=tls, reuse_port=cfg.reuse_port, header_timeout_s=cfg.http_header_timeout_s,
            max_connections=cfg.http_max_connections, answered=self._http_answered)

    def _takers(self, role: str) -> list[WorkerInfo]:
        """Live workers of ``role`` (colocated ones in a colocated cluster) that take new requests
        and that the circuit breaker does not skip."""
        workers = self.view.workers("colocated") or self.view.workers(role)
        return [info for info, load in workers if not load.draining and self.breaker.state(info.address) == "closed"]

    def _cached_tokens(self, worker: WorkerInfo, prompt: list[int]) -> int:
        """Prompt tokens ``worker`` holds in its published prefix cache (0 without a cache index)."""
        entry = self.cache_index.get(worker.worker_id) if self.cache_index is not None else None
        return cached_prefix_tokens(prompt, *entry) if entry else 0

    def _http_answered(self, status: int) -> None:
        """Counts an answer of the HTTP port's connection guards (no head parsed: ``other``)."""
        self.metrics.inc("http_requests", method="other", handler="other", status=str(status))

    def serving_now(self) -> tuple[bool, str]:
        """Whether requests can be served now, and if not why (no live worker of a role)."""
        if any(not load.draining for _, load in self.view.workers("colocated")):
            return True, ""
        missing = [role for role in ("prefill", "decode")
                   if not any(not load.draining for _, load in self.view.workers(role))]
        return (not missing), (f"no live {' or '.join(missing)} worker" if missing else "")

    def _record(self) -> RouterRecord:
        """This router's record for the cluster's other routers (:mod:`router.peers`)."""
        host = self.cfg.advertise_host or self.cfg.host
        return RouterRecord(index=self.cfg.index, pid=os.getpid(), address=f"{host}:{self.port}",
                            metrics_address=self.metrics_address, started_at=self.started_at)

    def scrape_targets(self) -> list[dict]:
        """Prometheus HTTP service discovery: every live process' ``/metrics`` with its role and id
        (each router's own private ``/metrics``, not the shared HTTP port, which reaches any one)."""
        out = [{"targets": [r.metrics_address], "labels": {"role": "router", "worker_id": r.router_id}}
               for r in self.peers.live()]
        for info, _ in self.view.workers():
            if info.metrics_address:
                out.append({"targets": [info.metrics_address], "labels": {"role": info.role,
                                                                         "worker_id": info.worker_id}})
        return out

    def _watch_health(self) -> None:
        serving = None
        for period in itertools.count():
            if self._stop.is_set():
                break
            now, _ = self.serving_now()
            self.breaker.retain(self.view.addresses())  # workers gone from the registry: their breakers too
            if now != serving:
                set_serving(self.health, [SERVICE], serving=now)
                serving = now
            if period % PEER_PERIODS == 0:  # the controller reports once per heartbeat
                try:
                    self.fleet.update()
                except Exception as e:  # noqa: BLE001 - a malformed report must not end the health thread
                    log.warning("fleet gauges not updated: %r", e)
            self._stop.wait(self.cfg.view_period_s)

    def start(self) -> str:
        self.view.start()
        if self.cache_index is not None:
            self.cache_index.start()
        set_serving(self.health, [SERVICE], serving=False)
        self.metrics_http.start()
        self.server.start()
        if self.http is not None:
            self.http_address = f"{self.cfg.host}:{self.http.start()}"
        self._health_thread.start()
        self.started_at = time.time()
        self.peers.start()
        gc.collect()
        gc.freeze()  # what start-up built is never collected: no full collection walks it mid-burst
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        self._stop.set()
        set_serving(self.health, [SERVICE], serving=False)
        if self.http is not None:
            self.http.stop()
        self.server.stop(grace_s).wait()
        self.peers.stop()
        if self._health_thread.is_alive():
            self._health_thread.join(timeout=5)
        self.fleet.close()
        self.metrics_http.stop()
        self.view.stop()
        if self.cache_index is not None:
            self.cache_index.stop()
