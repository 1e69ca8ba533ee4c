"""Assemble a prefill worker: model runner, scheduler, KV sender, gRPC server."""

from __future__ import annotations

from functools import partial

from engine.builder import build_runner
from engine.structured_output import grammar_compiler
from kvtransfer.blocks import HeadShards
from kvtransfer.registry import create_sender
from pdcluster.v1 import worker_pb2_grpc
from prefill_worker.scheduler import PrefillScheduler
from prefill_worker.server import PrefillWorkerServicer, remote_route
from serving.cache_index import CacheIndexPublisher
from serving.security import internal_channel
from serving.worker_config import WorkerConfig
from serving.worker_host import WorkerHost
from serving.worker_metrics import WorkerMetrics

SERVICES = ["pdcluster.v1.PrefillWorker"]


def _model_id(name: str, cfg: WorkerConfig) -> str:
    """The prefix-cache hash salt: model, KV dtype and (when not float) the weights' quantization, so
    KV computed with other weights never counts as a cache hit."""
    quant = "" if cfg.quantization == "none" else f":{cfg.quantization}"
    return f"{name}:{cfg.cache.dtype}{quant}"


def create_prefill_worker(cfg: WorkerConfig, port: int = 0, node_id: str = "") -> WorkerHost:
    """Build (not start) a prefill worker; its KV sender comes from the transport registry by ``cfg.kv``
    and sends the cluster secret of ``cfg.security``."""
    model_cfg, runner = build_runner(cfg.model, cfg.cache, **cfg.runner_options())
    metrics = WorkerMetrics(cfg, lambda: sched.load())
    sched = PrefillScheduler(runner, cfg.cache, cfg.scheduler, model_id=_model_id(model_cfg.name, cfg),
                             layerwise=cfg.kv.layerwise, on_step=metrics.on_step,
                             eos_token_ids=model_cfg.eos_token_ids, on_computed=metrics.prefill_computed)
    sender = create_sender(cfg.kv, partial(internal_channel, cfg.security))
    route = remote_route(sender, HeadShards.of(runner.kv_parts), cfg.kv.layers_per_chunk)
    servicer = PrefillWorkerServicer(sched, route, cfg.worker_id, runner.device, metrics=metrics,
                                     vocab_size=model_cfg.vocab_size, grammars=grammar_compiler(model_cfg))

    def add(server):
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)

    companions = []
    if cfg.cache.enable_prefix_caching:
        companions.append(CacheIndexPublisher(cfg.redis_url, cfg.cluster, cfg.worker_id, sched.pool.cached_hashes,
                                              sched.model_id, cfg.cache.block_size, period_s=cfg.heartbeat_s))
    return WorkerHost(cfg, sched, add, SERVICES, port=port, block_size=cfg.cache.block_size,
                      num_total_blocks=sched.pool.num_usable, node_id=node_id, companions=companions,
                      metrics=metrics, on_stopped=runner.close, runner=runner)
