"""Assemble a decode worker: model runner, scheduler, KV receiver, gRPC server."""

from __future__ import annotations

from decode_worker.kv_sink import DecodeKvSink
from decode_worker.scheduler import DecodeScheduler
from decode_worker.server import DecodeWorkerServicer
from engine.builder import build_runner
from engine.structured_output import grammar_compiler
from kvtransfer.registry import attach_receiver
from pdcluster.v1 import worker_pb2_grpc
from serving.worker_config import WorkerConfig
from serving.worker_host import WorkerHost
from serving.worker_metrics import WorkerMetrics

SERVICES = ["pdcluster.v1.DecodeWorker", "pdcluster.v1.KvTransfer"]


def create_decode_worker(cfg: WorkerConfig, port: int = 0, node_id: str = "") -> WorkerHost:
    """Build (not start) a decode worker.

    Its KV receiver is the one ``cfg.kv`` names in the transport registry, attached to a
    gRPC server (port and thread pool) of its own.
    """
    model_cfg, runner = build_runner(cfg.model, cfg.cache, **cfg.runner_options())
    metrics = WorkerMetrics(cfg, lambda: sched.load())
    sched = DecodeScheduler(runner, cfg.cache, cfg.scheduler, model_cfg.eos_token_ids, on_step=metrics.on_step)
    sink = DecodeKvSink(sched, on_write=metrics.kv_received)
    host = WorkerHost(cfg, sched, lambda server: None, SERVICES, port=port,
                      add_kv_servicers=lambda server: attach_receiver(cfg.kv, server, sink),
                      block_size=cfg.cache.block_size, num_total_blocks=sched.kv.num_usable,
                      node_id=node_id, metrics=metrics, on_stopped=runner.close, runner=runner)
    servicer = DecodeWorkerServicer(sched, cfg.worker_id, host.kv_address, cfg.cache.block_size,
                                    cfg.cache.dtype, runner.device, metrics=metrics,
                                    max_reserves=cfg.scheduler.max_num_seqs + cfg.max_queued_requests,
                                    vocab_size=model_cfg.vocab_size, grammars=grammar_compiler(model_cfg))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, host.server)
    return host
