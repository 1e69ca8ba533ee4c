"""One in-flight request on the router: its two worker calls and what a failed
prefill call does to the decode side.

When the ``Prefill`` call fails, the KV of the request's reservation will not
arrive. For a failure of the prefill side itself (worker lost, transfer failed,
model step failed) the router tells the decode worker with
``DecodeWorker.FailTransfer`` and lets it apply its KV failure policy: under
"error" its ``Reserve`` stream ends with UNAVAILABLE and the router migrates the
request with the prefill worker's own status as the cause (:mod:`router.migration`);
under "recompute" it rebuilds the KV itself and the stream goes on (the prefill
error is forgotten). A handle is one attempt of a request: a migration starts a
new one, so a late callback of a failed attempt never touches the next one's calls. A cancelled prefill call (client
abort, destination released) or a request the prefill side rejected frees both
sides at once, as does a ``FailTransfer`` that fails (decode unreachable) or finds
no such request.
"""

from __future__ import annotations

import logging

import grpc

from pdcluster.v1 import worker_pb2

log = logging.getLogger(__name__)

# Prefill failures the decode worker may recover from by recomputing the prompt.
RECOVERABLE_PREFILL_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
})
_OUTCOME = worker_pb2.FailTransferResponse
_DECODE_GOES_ON = (_OUTCOME.OUTCOME_RECOMPUTING, _OUTCOME.OUTCOME_KV_COMPLETE)


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """gRPC status code and details of a failed call's exception (UNAVAILABLE and its
    text for anything that is not a gRPC error)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNAVAILABLE
    details = err.details() if hasattr(err, "details") else str(err)
    return code, details or ""


class RequestHandle:
    """The router's state of one attempt of a request (its first, or one after a migration).

    Attributes:
        request_id: the id its workers see (:func:`router.migration.attempt_request_id`).
        first_id: the id the request's workers saw for its first attempt (migrations' ids
            derive from it); ``request_id`` itself for a first attempt.
        aborted: the client aborted the request.
        decode / prefill: the chosen workers' registry entries.
        d_call: the decode worker's ``Reserve`` stream; ``p_future``: the ``Prefill`` call.
        decode_stub: stub of the decode worker (for ``FailTransfer``); ``transfer_id``.
        prefill_error: the failed prefill call's exception while it decides the
            request's fate (cleared when the decode worker recomputes instead).
        fail_transfer_timeout_s: deadline of the ``FailTransfer`` call (seconds).
        load: the request's share of the router's load (:class:`router.load.RequestLoad`).
    """

    def __init__(self, request_id: str, fail_transfer_timeout_s: float = 10.0, first_id: str = "") -> None:
        self.request_id = request_id
        self.first_id = first_id or request_id
        self.decode = None
        self.prefill = None
        self.d_call = None
        self.p_future = None
        self.decode_stub = None
        self.transfer_id = ""
        self.aborted = False
        self.prefill_error: grpc.RpcError | None = None
        self.fail_transfer_timeout_s = fail_transfer_timeout_s
        self.load = None

    def cancel_calls(self) -> None:
        """Cancel both worker calls; each worker then frees the request's blocks."""
        if self.d_call is not None:
            self.d_call.cancel()
        if self.p_future is not None and not self.p_future.done():
            self.p_future.cancel()

    def on_prefill_done(self, fut) -> None:
        """Done-callback of the ``Prefill`` future (a gRPC thread: never blocks)."""
        if fut.cancelled() or self.aborted:
            return
        err = fut.exception()
        if err is None:
            return
        self.prefill_error = err
        if self.d_call is None:
            return
        code, details = status_of(err)
        if code not in RECOVERABLE_PREFILL_CODES or self.decode_stub is None:
            self.d_call.cancel()
            return
        prefill_id = self.prefill.worker_id if self.prefill is not None else "?"
        req = worker_pb2.FailTransferRequest(request_id=self.request_id, transfer_id=self.transfer_id,
                                             reason=f"prefill worker {prefill_id}: {code.name}: {details}")
        try:
            call = self.decode_stub.FailTransfer.future(req, timeout=self.fail_transfer_timeout_s)
        except Exception:
            log.exception("FailTransfer for %s could not be sent; cancelling the decode call", self.request_id)
            self.d_call.cancel()
            return
        call.add_done_callback(self._on_fail_transfer_answer)

    def _on_fail_transfer_answer(self, call) -> None:
        try:
            outcome = call.result().outcome
        except Exception as e:  # noqa: BLE001 - decode unreachable: fall back to cancelling
            code, details = status_of(e)  # one line: the status, not the call's multi-line repr
            log.warning("FailTransfer for %s failed (%s: %s); cancelling the decode call", self.request_id,
                        code.name, " ".join(details.split()))
            self.d_call.cancel()
            return
        if outcome in _DECODE_GOES_ON:
            log.info("decode worker goes on with %s after its prefill failed (%s)", self.request_id,
                     _OUTCOME.Outcome.Name(outcome))
            self.prefill_error = None
        elif outcome != _OUTCOME.OUTCOME_FAILED:
            self.d_call.cancel()  # not there any more (or never reserved): make sure it is freed
        # OUTCOME_FAILED: the decode stream ends with UNAVAILABLE on its own
