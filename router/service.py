"""The ``Router`` gRPC service: validate, place, relay, abort.

Per request (DESIGN.md "decode-led reservation, prefill push"): the placement step
(:mod:`router.placement`) picks a decode worker D and a prefill worker P (one worker
for both in a colocated cluster); ``D.Reserve`` allocates blocks and opens the
token stream; ``P.Prefill`` (with D's block ids) computes the prompt and pushes
its KV to D; D's token stream is detokenized here and relayed to the client.
An abort, a client disconnect or a decode worker failure cancels both calls, which
makes both workers free the request's blocks. A failed prefill call is reported to
the decode worker, whose KV failure policy decides whether the request fails or is
recomputed there (:mod:`router.handle`).
"""

from __future__ import annotations

import logging
import threading
import uuid

import grpc

from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from router.handle import RequestHandle, status_of
from router.load import LoadTracker
from router.output import OutputAssembler
from router.placement import Placer
from router.policy import NoWorkerError, RequestContext
from router.stubs import StubCache
from router.validation import InvalidRequest, PreparedRequest, RequestValidator

log = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Front door. Handlers block only on their own request's calls.

    Args:
        validator: request validation and tokenization.
        tokenizer: for detokenization.
        placer: the placement step (its registry view also learns of unreachable workers).
        load: the router's per-worker load, which the placer's policy reads; counted
            here from placement until the request ends.
        model_info: answer of ``GetModelInfo``.
    """

    def __init__(self, validator: RequestValidator, tokenizer, placer: Placer, load: LoadTracker,
                 model_info: router_pb2.ModelInfo) -> None:
        self.validator = validator
        self.tokenizer = tokenizer
        self.placer = placer
        self.view = placer.view
        self.load = load
        self.model_info = model_info
        self.stubs = StubCache()
        self._lock = threading.Lock()
        self._table: dict[str, RequestHandle] = {}

    # ---- RPCs ---------------------------------------------------------------------
    def Generate(self, request, context):
        try:
            prep = self.validator.prepare(request)
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        handle = RequestHandle(prep.request_id)
        with self._lock:
            if prep.request_id in self._table:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {prep.request_id!r} is already running")
            self._table[prep.request_id] = handle
        try:
            yield from self._serve(prep, handle, context)
        finally:
            with self._lock:
                self._table.pop(prep.request_id, None)

    def Abort(self, request, context):
        with self._lock:
            handle = self._table.get(request.request_id)
        if handle is None:
            return router_pb2.AbortResponse(found=False)
        handle.aborted = True
        for role, info in (("decode", handle.decode), ("prefill", handle.prefill)):
            if info is None:
                continue
            try:
                self.stubs.get(role, info.address).Abort(
                    worker_pb2.WorkerAbortRequest(request_id=request.request_id), timeout=2.0)
            except grpc.RpcError as e:
                log.warning("abort on %s worker %s failed: %s", role, info.worker_id, e.code())
        return router_pb2.AbortResponse(found=True)

    def GetModelInfo(self, request, context):
        return self.model_info

    # ---- the relay ----------------------------------------------------------------
    def _serve(self, prep: PreparedRequest, h: RequestHandle, context):
        try:
            placement = self.placer.place(RequestContext(prep.request_id, prep.prompt_token_ids))
        except NoWorkerError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        h.prefill, h.decode = placement.prefill, placement.decode
        h.load = self.load.begin(h.prefill.worker_id, h.decode.worker_id, len(prep.prompt_token_ids))
        context.add_callback(h.cancel_calls)  # client cancelled or disconnected
        try:
            yield from self._relay(prep, h, context)
        finally:
            h.load.end()

    def _relay(self, prep: PreparedRequest, h: RequestHandle, context):
        transfer_id = h.transfer_id = uuid.uuid4().hex
        out = OutputAssembler(self.tokenizer, prep.request_id, prep.prompt_token_ids, prep.stop)
        h.decode_stub = self.stubs.get("decode", h.decode.address)
        h.d_call = h.decode_stub.Reserve(
            worker_pb2.ReserveRequest(request=prep.worker_request, transfer_id=transfer_id))
        try:
            first = next(h.d_call)
            if h.aborted:
                h.cancel_calls()
                yield from self._final(out, prep, common_pb2.FINISH_REASON_ABORT)
                return
            h.p_future = self.stubs.get("prefill", h.prefill.address).Prefill.future(
                worker_pb2.PrefillRequest(request=prep.worker_request, transfer_id=transfer_id,
                                          destination=first.reservation))
            h.p_future.add_done_callback(h.on_prefill_done)
            h.p_future.add_done_callback(h.load.prefill_finished)
            decode_finished = False
            for ev in h.d_call:
                msg = out.add(ev.tokens)
                if out.finished:
                    self._settle_usage(h, out, msg)
                decode_finished = ev.tokens.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                if prep.stream and (msg.token_ids or msg.text or out.finished):
                    yield msg
                if out.finished:
                    break
                if h.aborted:
                    yield from self._final(out, prep, common_pb2.FINISH_REASON_ABORT)
                    break
        except grpc.RpcError as e:
            self._fail(h, e, context)
            return
        if not out.finished:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"decode worker {h.decode.worker_id} closed the stream before finishing")
        if not decode_finished:
            h.d_call.cancel()  # stopped here (stop string / abort): the decode worker frees
        if not prep.stream:
            yield out.whole()

    @staticmethod
    def _settle_usage(h: RequestHandle, out: OutputAssembler, msg) -> None:
        """Fill cached_prompt_tokens from the prefill worker's answer, which follows the
        decode side's acknowledgement by moments (waits at most 5 s)."""
        try:
            res = h.p_future.result(timeout=5.0)
        except Exception:  # noqa: BLE001 - failed/cancelled prefill: usage stays without cache info
            return
        out.cached_prompt_tokens = res.cached_prompt_tokens
        msg.usage.cached_prompt_tokens = res.cached_prompt_tokens

    def _final(self, out: OutputAssembler, prep: PreparedRequest, reason: int):
        out.finish_reason = reason
        if prep.stream:
            yield router_pb2.GenerateResponse(request_id=prep.request_id, finish_reason=reason, usage=out.usage())

    def _fail(self, h: RequestHandle, e: grpc.RpcError, context) -> None:
        """Map a worker failure onto the client's status; never returns."""
        h.cancel_calls()
        if h.prefill_error is not None:
            code, details = status_of(h.prefill_error)
            if code == grpc.StatusCode.UNAVAILABLE and "KV transfer failed" not in details:
                self.view.mark_unreachable(h.prefill.worker_id)  # lost, not just its transfer
            context.abort(code, f"prefill worker {h.prefill.worker_id}: {details}")
        if e.code() == grpc.StatusCode.CANCELLED and not context.is_active():
            context.abort(grpc.StatusCode.CANCELLED, "client cancelled")
        if e.code() == grpc.StatusCode.UNAVAILABLE and "KV" not in (e.details() or ""):
            self.view.mark_unreachable(h.decode.worker_id)
        context.abort(e.code(), f"decode worker {h.decode.worker_id}: {e.details()}")
