"""A colocated worker: prefill and decode on one model replica and one KV pool.

It serves both the ``PrefillWorker`` and ``DecodeWorker`` services and registers
with role ``colocated``; the router sends both halves of a request to it. One loop
thread interleaves the two schedulers (a prefill step, then a decode step), which
is the usual single-instance serving that disaggregation is compared against: a
prefill step stalls the running decode batch. The decode scheduler owns every
block; the prefill scheduler writes a prompt's KV straight into the blocks the
decode side reserved (no copy), and "delivery" is a local completion.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

import torch

from decode_worker.kv_sink import DecodeKvSink
from decode_worker.scheduler import DecodeScheduler
from decode_worker.server import DecodeWorkerServicer
from engine.builder import build_runner
from engine.structured_output import grammar_compiler
from engine.request import Request
from kvtransfer.blocks import HeadShards
from kvtransfer.progress import LayerProgress
from kvtransfer.registry import attach_receiver, create_sender
from pdcluster.v1 import worker_pb2, worker_pb2_grpc
from prefill_worker.contracts import ExternalBlocks
from prefill_worker.scheduler import PrefillScheduler
from prefill_worker.server import PrefillWorkerServicer, Route, remote_route
from serving.convert import logprobs_from_dict
from serving.security import internal_channel
from serving.worker_config import WorkerConfig
from serving.worker_host import WorkerHost
from serving.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)
SERVICES = ["pdcluster.v1.PrefillWorker", "pdcluster.v1.DecodeWorker", "pdcluster.v1.KvTransfer"]


class ColocatedLoop:
    """Drives both schedulers from one thread: prefill step, then decode step."""

    def __init__(self, prefill: PrefillScheduler, decode: DecodeScheduler, wake: threading.Event) -> None:
        self.prefill = prefill
        self.decode = decode
        self.wake = wake

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.wake.clear()
            try:
                worked = self.prefill.step(block=False)
                worked = self.decode.step(block=False) or worked
            except Exception:  # noqa: BLE001 - a scheduler bug must not kill the loop thread
                log.exception("colocated step raised; continuing")
                worked = False
                time.sleep(0.01)
            if not worked:
                self.wake.wait(0.05)

    def load(self) -> dict:
        d, p = self.decode.load(), self.prefill.load()
        return {**d, "num_waiting": d["num_waiting"] + p["num_waiting"]}


def local_route(worker_id: str, decode: DecodeScheduler, fallback: Route) -> Route:
    """KV for this worker's own reservations is written in place; anything else is sent."""

    def route(msg: worker_pb2.PrefillRequest, req: Request):
        dest = msg.destination
        if dest.worker_id != worker_id:
            return fallback(msg, req)
        tid, gen = req.transfer_id, dest.generation

        def complete(r: Request, progress: LayerProgress) -> int:
            first_token, lp = progress.wait_finished(timeout_s=60.0)
            decode.kv_complete(tid, gen, first_token, logprobs_from_dict(lp))
            return 0

        return complete, ExternalBlocks(list(dest.block_ids), lambda: decode.transfers.is_open(tid, gen))

    return route


def create_colocated_worker(cfg: WorkerConfig, port: int = 0, node_id: str = "") -> WorkerHost:
    """Build (not start) a colocated worker; its KV sender and receiver (for other workers'
    requests) come from the transport registry by ``cfg.kv``."""
    model_cfg, runner = build_runner(cfg.model, cfg.cache, **cfg.runner_options())
    wake = threading.Event()
    metrics = WorkerMetrics(cfg, lambda: loop.load())
    decode = DecodeScheduler(runner, cfg.cache, cfg.scheduler, model_cfg.eos_token_ids, wake=wake,
                             on_step=metrics.on_step)
    prefill = PrefillScheduler(runner, cfg.cache, cfg.scheduler, wake=wake, layerwise=cfg.kv.layerwise,
                               on_step=metrics.on_step, eos_token_ids=model_cfg.eos_token_ids)
    loop = ColocatedLoop(prefill, decode, wake)
    sink = DecodeKvSink(decode, on_write=metrics.kv_received)
    host = WorkerHost(cfg, loop, lambda server: None, SERVICES, port=port,
                      add_kv_servicers=lambda server: attach_receiver(cfg.kv, server, sink),
                      block_size=cfg.cache.block_size, num_total_blocks=decode.kv.num_usable, node_id=node_id,
                      metrics=metrics, on_stopped=runner.close, runner=runner)
    device: torch.device = runner.device
    route = local_route(cfg.worker_id, decode,
                        remote_route(create_sender(cfg.kv, partial(internal_channel, cfg.security)),
                                     HeadShards.of(runner.kv_parts),
                                     cfg.kv.layers_per_chunk))
    grammars = grammar_compiler(model_cfg)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(
        PrefillWorkerServicer(prefill, route, cfg.worker_id, device, metrics=metrics,
                              vocab_size=model_cfg.vocab_size, grammars=grammars), host.server)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(
        DecodeWorkerServicer(decode, cfg.worker_id, host.kv_address, cfg.cache.block_size, cfg.cache.dtype, device,
                             metrics=metrics, max_reserves=cfg.scheduler.max_num_seqs + cfg.max_queued_requests,
                             vocab_size=model_cfg.vocab_size, grammars=grammars),
        host.server)
    return host
