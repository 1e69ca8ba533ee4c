"""gRPC front of a prefill worker: ``PrefillWorker`` (router-facing)."""

from __future__ import annotations

import logging
from typing import Callable

import grpc
import torch

from engine.request import Request
from engine.structured_output import GrammarBusy, GrammarCompiler
from kvtransfer import KvSender
from kvtransfer.progress import LayerProgress
from pdcluster.v1 import worker_pb2, worker_pb2_grpc
from prefill_worker.contracts import ExternalBlocks, PrefillError, SendFn
from prefill_worker.scheduler import PrefillScheduler
from serving.convert import logprobs_to_proto, request_from_proto
from serving.logs import request_id_from_metadata, request_scope
from serving.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)

# route(prefill_request, request) -> (send function, external destination blocks or None)
Route = Callable[[worker_pb2.PrefillRequest, Request], tuple[SendFn, "ExternalBlocks | None"]]


def remote_route(sender: KvSender, kv_cache: torch.Tensor, layers_per_chunk: int) -> Route:
    """Push the KV to the destination decode worker through ``sender`` (the normal path);
    chunks leave as ``progress`` reports their layers computed."""

    def route(msg: worker_pb2.PrefillRequest, req: Request):
        dest = msg.destination

        def send(r: Request, progress: LayerProgress) -> int:
            result = sender.send(r.request_id, r.transfer_id, dest, kv_cache, list(r.block_table),
                                 None, layers_per_chunk=layers_per_chunk, progress=progress)
            return result.bytes_sent

        return send, None

    return route


class PrefillWorkerServicer(worker_pb2_grpc.PrefillWorkerServicer):
    """``Prefill`` queues the request and waits until its KV was delivered (acknowledged)."""

    def __init__(self, scheduler: PrefillScheduler, route: Route, worker_id: str, device: torch.device,
                 metrics: WorkerMetrics | None = None, vocab_size: int | None = None,
                 grammars: GrammarCompiler | None = None) -> None:
        self.vocab_size = vocab_size  # token ids are checked against it (None: not checked)
        self.grammars = grammars  # compiles structured outputs (None: refused)
        self.scheduler = scheduler
        self.metrics = metrics
        self.route = route
        self.worker_id = worker_id
        self.device = device

    def Prefill(self, request, context):
        with request_scope(request_id_from_metadata(context) or request.request.request_id):
            try:
                req = request_from_proto(request.request, request.transfer_id, self.device, self.vocab_size,
                                         self.grammars)
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except GrammarBusy as e:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            log.debug("prefill: %d prompt tokens, KV to %s", len(req.prompt_token_ids), request.destination.worker_id)
            send, external = self.route(request, req)
            fut = self.scheduler.submit(req, send, external)
            abort = lambda: None if fut.done() else self.scheduler.submit_abort(req.request_id)  # noqa: E731
            if not context.add_callback(abort):  # cancelled before: a terminated call runs no callback
                log.info("prefill of %s cancelled by the caller before it was queued: aborting it", req.request_id)
                abort()
            try:
                res = fut.result()
            except PrefillError as e:
                if self.metrics is not None and "KV transfer failed" in str(e):
                    self.metrics.kv_failed(e.code.name.lower())
                log.info("prefill failed: %s", e)
                context.abort(e.code, str(e))
            if self.metrics is not None:
                self.metrics.kv_sent(kv_bytes=res.kv_bytes_sent, transfer_s=res.transfer_total_s)
            return worker_pb2.PrefillResponse(
                first_token_id=res.first_token_id, cached_prompt_tokens=res.cached_tokens,
                kv_bytes_sent=res.kv_bytes_sent, prefill_seconds=res.prefill_s, transfer_seconds=res.transfer_s,
                prompt_logprobs=[logprobs_to_proto(t, lp) for t, lp in
                                 zip(req.prompt_token_ids[1:], res.prompt_logprobs)])

    def Abort(self, request, context):
        found = self.scheduler.has_request(request.request_id)
        self.scheduler.submit_abort(request.request_id)
        return worker_pb2.WorkerAbortResponse(found=found)

    def GetLoad(self, request, context):
        return worker_pb2.WorkerLoad(worker_id=self.worker_id, role="prefill", **self.scheduler.load())
