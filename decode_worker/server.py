"""gRPC front of a decode worker: ``DecodeWorker`` (router-facing)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout

import grpc
import torch

from decode_worker.events import Failed, Reserved, Tokens
from decode_worker.kv_failure import KvFailureOutcome
from decode_worker.scheduler import DecodeScheduler
from engine.structured_output import GrammarBusy, GrammarCompiler
from pdcluster.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from serving.convert import logprobs_to_proto, request_from_proto
from serving.logs import request_id_from_metadata, request_scope
from serving.rpc import refuse
from serving.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)

FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
_OUTCOME = worker_pb2.FailTransferResponse
OUTCOMES = {
    KvFailureOutcome.UNKNOWN_REQUEST: _OUTCOME.OUTCOME_UNKNOWN_REQUEST,
    KvFailureOutcome.FAILED: _OUTCOME.OUTCOME_FAILED,
    KvFailureOutcome.RECOMPUTING: _OUTCOME.OUTCOME_RECOMPUTING,
    KvFailureOutcome.KV_COMPLETE: _OUTCOME.OUTCOME_KV_COMPLETE,
}


RETRY_AFTER_MS = 1000
"""The retry-after hint of a ``Reserve`` refused because the worker's queue is full (ms)."""


class DecodeWorkerServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """Handlers only enqueue work and relay the scheduler's events.

    Args:
        reply_timeout_s: how long ``FailTransfer`` waits for the scheduler loop's
            answer (seconds) before ending with DEADLINE_EXCEEDED.
        max_reserves: ``Reserve`` calls held at once (``max_num_seqs`` + the worker's
            ``max_queued_requests``; each holds a server thread until its stream ends); one more
            is refused at once with RESOURCE_EXHAUSTED and a ``retry-after-ms`` hint, before
            anything is allocated. ``None``: no limit.
        vocab_size: token ids of a ``Reserve`` must be below it (``None``: not checked).
        grammars: compiles a request's structured output (``None``: such a request is refused).
    """

    def __init__(self, scheduler: DecodeScheduler, worker_id: str, kv_endpoint: str,
                 block_size: int, dtype: str, device: torch.device, reply_timeout_s: float = 10.0,
                 metrics: WorkerMetrics | None = None, max_reserves: int | None = None,
                 vocab_size: int | None = None, grammars: GrammarCompiler | None = None) -> None:
        if max_reserves is not None and max_reserves < 1:
            raise ValueError(f"max_reserves must be >= 1, got {max_reserves}")
        self.max_reserves = max_reserves
        self._held = 0
        self._held_lock = threading.Lock()
        self.scheduler = scheduler
        self.metrics = metrics
        self.reply_timeout_s = reply_timeout_s
        self.worker_id = worker_id
        self.kv_endpoint = kv_endpoint
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.vocab_size = vocab_size
        self.grammars = grammars

    def Reserve(self, request, context):
        rid = request.request.request_id
        with request_scope(request_id_from_metadata(context) or rid):
            if not self._hold():
                log.info("reserve refused: %d Reserve calls held (max_num_seqs + max_queued_requests)",
                         self.max_reserves)
                if self.metrics is not None:
                    self.metrics.rejected("queue_full")
                refuse(context, f"decode worker {self.worker_id}: queue full ({self.max_reserves} requests held: "
                                f"max_num_seqs + max_queued_requests)", RETRY_AFTER_MS)
            try:
                yield from self._reserve(request, context)
            finally:
                with self._held_lock:
                    self._held -= 1

    def _hold(self) -> bool:
        """Count one more ``Reserve`` in progress (False: the limit is reached, nothing counted)."""
        with self._held_lock:
            if self.max_reserves is not None and self._held >= self.max_reserves:
                return False
            self._held += 1
            return True

    def _reserve(self, request, context):
        try:
            if not request.transfer_id:
                raise ValueError("transfer_id is empty")
            req = request_from_proto(request.request, request.transfer_id, self.device, self.vocab_size,
                                     self.grammars)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except GrammarBusy as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        events: queue.SimpleQueue = queue.SimpleQueue()  # get() waits in C: less GIL per token than Queue
        t0 = time.monotonic()
        log.debug("reserve: %d prompt tokens, %d earlier output tokens, max_tokens %d", len(req.prompt_token_ids),
                  len(req.output_token_ids), req.params.max_tokens)
        if not self._queue_reserve(req, events, context):
            return
        while True:
            try:
                ev = events.get(timeout=0.5)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if isinstance(ev, Reserved):
                if self.metrics is not None:
                    self.metrics.reserved(time.monotonic() - t0)
                yield worker_pb2.DecodeEvent(reservation=worker_pb2.KvDestination(
                    worker_id=self.worker_id, kv_endpoint=self.kv_endpoint, block_ids=ev.block_ids,
                    block_size=self.block_size, generation=ev.generation, dtype=self.dtype))
            elif isinstance(ev, Tokens):
                yield worker_pb2.DecodeEvent(tokens=self._delta(ev, request.request.sampling.logprobs))
                if ev.finish_reason:
                    return
            elif isinstance(ev, Failed):
                log.info("request failed: %s", ev.message)
                context.abort(ev.code, ev.message)

    def _queue_reserve(self, req, events: queue.SimpleQueue, context) -> bool:
        """Queue ``req``'s reservation so that the end of its ``Reserve`` call, whenever it
        comes, aborts it: the call's termination callback queues an abort of this
        reservation (its event stream: a refused duplicate ends no other call's request), which
        must reach the scheduler after the reservation.
        Returns False when the caller cancelled the call meanwhile (nothing left to stream):

        * before the callback was registered (a terminated call runs no callback it is
          given afterwards): nothing is queued;
        * between registering it and queueing the reservation: the callback's abort went
          first (a no-op there), so one more abort follows the reservation.
        """
        rid, transfer_id = req.request_id, req.transfer_id
        if not context.add_callback(lambda: self.scheduler.submit_abort(rid, transfer_id, events)):
            log.info("reserve of %s cancelled by the caller before it was queued: nothing reserved", rid)
            return False
        self.scheduler.submit_reserve(req, events)
        if context.is_active():
            return True
        log.info("reserve of %s cancelled by the caller while it was queued: aborting it", rid)
        self.scheduler.submit_abort(rid, transfer_id, events)
        return False

    @staticmethod
    def _delta(ev: Tokens, logprobs: int) -> worker_pb2.TokenDelta:
        delta = worker_pb2.TokenDelta(token_ids=ev.token_ids)
        if logprobs:
            delta.logprobs.extend(logprobs_to_proto(t, lp) for t, lp in zip(ev.token_ids, ev.logprobs))
        if ev.finish_reason:
            delta.finish_reason = FINISH[ev.finish_reason]
        return delta

    def Abort(self, request, context):
        found = self.scheduler.has_request(request.request_id)
        self.scheduler.submit_abort(request.request_id)
        return worker_pb2.WorkerAbortResponse(found=found)

    def FailTransfer(self, request, context):
        """Apply the KV failure policy to a reservation whose prefill side failed.

        Ends with INVALID_ARGUMENT when ``request_id`` or ``transfer_id`` is empty and
        DEADLINE_EXCEEDED when the scheduler loop does not answer in time."""
        if not request.request_id or not request.transfer_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "FailTransfer needs request_id and transfer_id")
        reply = self.scheduler.submit_fail_transfer(request.request_id, request.transfer_id,
                                                    request.reason or "no reason given")
        try:
            outcome = reply.result(timeout=self.reply_timeout_s)
        except FutureTimeout:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"decode worker {self.worker_id}: scheduler did not answer FailTransfer within "
                          f"{self.reply_timeout_s:.1f}s")
        return worker_pb2.FailTransferResponse(outcome=OUTCOMES[outcome])

    def GetLoad(self, request, context):
        return worker_pb2.WorkerLoad(worker_id=self.worker_id, role="decode", **self.scheduler.load())
