"""What the router learns from its own calls to the workers: every internal call's outcome feeds
the circuit breaker (:mod:`router.breaker`), every ``Prefill`` call the prefill-rate meter
(:class:`router.load.PrefillRates`). Both come from a client interceptor on the router's
channels (:func:`watched_channel`), so the request path needs no bookkeeping of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.breaker import CircuitBreaker, classify
from router.load import PrefillRates
from serving.rpc import handler_status

log = logging.getLogger(__name__)

PREFILL_METHOD = "/pdcluster.v1.PrefillWorker/Prefill"


class _Watch(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Reports the end of every call on one worker's channel."""

    def __init__(self, address: str, breaker: CircuitBreaker, rates: PrefillRates) -> None:
        self.address = address
        self.breaker = breaker
        self.rates = rates

    def intercept_unary_unary(self, continuation, client_call_details, request):
        prefill = client_call_details.method == PREFILL_METHOD
        if prefill:
            self.rates.started(self.address)
        try:
            call = continuation(client_call_details, request)
        except Exception:
            if prefill:
                self.rates.finished(self.address, 0)
            raise
        call.add_done_callback(lambda c: self._done(c, request if prefill else None))
        return call

    def intercept_unary_stream(self, continuation, client_call_details, request):
        call = continuation(client_call_details, request)
        call.add_done_callback(lambda c: self._done(c, None))
        return call

    def _done(self, call, prefill_request) -> None:
        """Done-callback (a gRPC thread: never blocks)."""
        try:
            code = call.code()
            self.breaker.record(self.address, classify(code, handler_status(call)),
                                f"{code.name}: {call.details()}")
            if prefill_request is not None:
                tokens = 0
                if code == grpc.StatusCode.OK:
                    tokens = max(0, len(prefill_request.request.prompt_token_ids) - call.result().cached_prompt_tokens)
                self.rates.finished(self.address, tokens)
        except Exception:  # noqa: BLE001 - bookkeeping must never break a call
            log.exception("recording the outcome of a call to %s failed", self.address)


def watched_channel(channel: grpc.Channel, address: str, breaker: CircuitBreaker, rates: PrefillRates) -> grpc.Channel:
    """``channel`` (to the worker at ``address``) reporting every call's end to ``breaker`` and
    every ``Prefill`` call to ``rates``."""
    return grpc.intercept_channel(channel, _Watch(address, breaker, rates))


def health_probe(connect: Callable[[str], grpc.Channel], timeout_s: float) -> Callable[[str], Future]:
    """The circuit breaker's probe: a gRPC health ``Check`` (overall server status) of a worker
    address with a ``timeout_s`` deadline; the future resolves True when it answers SERVING.
    One channel per address (made by ``connect``) is kept for probes."""
    channels: dict[str, grpc.Channel] = {}

    def probe(address: str) -> Future:
        channel = channels.get(address)
        if channel is None:
            channel = channels[address] = connect(address)
        out: Future = Future()
        call = health_pb2_grpc.HealthStub(channel).Check.future(health_pb2.HealthCheckRequest(), timeout=timeout_s)

        def done(c) -> None:
            try:
                out.set_result(c.result().status == health_pb2.HealthCheckResponse.SERVING)
            except Exception as e:  # noqa: BLE001 - any failure is an unhealthy answer
                out.set_exception(e)

        call.add_done_callback(done)
        return out

    return probe
