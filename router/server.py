"""Build and run the router: tokenizer, registry view, Router + health + reflection."""

from __future__ import annotations

from dataclasses import dataclass

from grpc_reflection.v1alpha import reflection

from common.model_config import ModelConfig
from common.tokenizer import load_tokenizer
from pdcluster.v1 import router_pb2, router_pb2_grpc
from router.load import LoadTracker
from router.placement import POLICIES, Placer, make_policy
from router.policy import Signals
from router.policy_names import DEFAULT_POLICY, check_policy
from router.service import RouterServicer
from router.validation import Limits, RequestValidator
from serving.cache_index import CacheIndexView
from serving.discovery import RegistryView
from serving.registry import WorkerRegistry
from serving.rpc import bind, make_server, set_serving

SERVICE = "pdcluster.v1.Router"


@dataclass(frozen=True)
class RouterConfig:
    """Router settings.

    Attributes:
        model: model name, as clients see it (``GetModelInfo``).
        model_path: the model's resolved HF folder (``deploy`` resolves the spec once,
            :func:`engine.model_loader.resolve_model`); the router reads only its
            ``config.json`` and tokenizer, so it never loads torch.
        redis_url / cluster: the worker registry.
        host / port: where clients connect (port 0 = any free port).
        max_model_len: prompt + max_tokens limit (tokens).
        block_size: decode workers' KV block size, reported by GetModelInfo.
        policy: the worker choice for every role, one of
            :data:`router.policy_names.POLICY_NAMES` (``pdcluster up --router-policy``):
            ``cache_aware`` (prefill workers by least expected prefill work given their
            published prefix caches, decode and colocated workers least loaded),
            ``least_loaded`` or ``round_robin``.
        view_period_s: how often the registry view refreshes (seconds).

    Raises:
        ValueError: a non-positive ``max_model_len`` or ``view_period_s``, or an
            unregistered ``policy`` (the message lists the registered names).
    """

    model: str
    model_path: str
    redis_url: str
    cluster: str = "default"
    host: str = "127.0.0.1"
    port: int = 50051
    max_model_len: int = 2048
    block_size: int = 16
    policy: str = DEFAULT_POLICY
    view_period_s: float = 0.25
    max_workers: int = 128

    def __post_init__(self) -> None:
        if self.max_model_len <= 0 or self.view_period_s <= 0:
            raise ValueError("max_model_len and view_period_s must be positive")
        check_policy(self.policy)


class RouterServer:
    """The router process' server. ``start()`` returns ``host:port``."""

    def __init__(self, cfg: RouterConfig) -> None:
        folder = cfg.model_path
        model_cfg = ModelConfig.from_hf_folder(folder, name=cfg.model)
        max_len = min(cfg.max_model_len, model_cfg.max_position_embeddings)
        tokenizer = load_tokenizer(folder)
        self.view = RegistryView(WorkerRegistry(cfg.redis_url, cfg.cluster), period_s=cfg.view_period_s)
        info = router_pb2.ModelInfo(model_name=cfg.model, max_model_len=max_len, vocab_size=model_cfg.vocab_size,
                                    eos_token_ids=list(model_cfg.eos_token_ids), block_size=cfg.block_size)
        self.cache_index = CacheIndexView(
            cfg.redis_url, cfg.cluster, lambda: [w.worker_id for w, _ in self.view.workers("prefill")],
            period_s=cfg.view_period_s) if POLICIES[cfg.policy].needs_cache_index else None
        load = LoadTracker()
        policy = make_policy(cfg.policy, Signals(load, self.cache_index))
        self.servicer = RouterServicer(
            RequestValidator(tokenizer, Limits(max_len, model_cfg.vocab_size)), tokenizer,
            Placer(self.view, policy), load, info)
        self.server, self.health = make_server(cfg.max_workers)
        router_pb2_grpc.add_RouterServicer_to_server(self.servicer, self.server)
        reflection.enable_server_reflection(
            (router_pb2.DESCRIPTOR.services_by_name["Router"].full_name, reflection.SERVICE_NAME,
             "grpc.health.v1.Health"), self.server)
        self.port = bind(self.server, cfg.host, cfg.port)
        self.address = f"{cfg.host}:{self.port}"

    def start(self) -> str:
        self.view.start()
        if self.cache_index is not None:
            self.cache_index.start()
        self.server.start()
        set_serving(self.health, [SERVICE])
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        set_serving(self.health, [SERVICE], serving=False)
        self.server.stop(grace_s).wait()
        self.view.stop()
        if self.cache_index is not None:
            self.cache_index.stop()
