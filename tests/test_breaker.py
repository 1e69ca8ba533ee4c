"""The router's circuit breaker without a cluster: the state machine on a fake clock (N transport
failures open it, client-caused and handler-set statuses never count, a success resets, the
cool-down ends in one probe that closes or re-opens it), placement skipping open workers, and
the channel interceptor classifying real gRPC outcomes (a worker's own status vs a refused
connection) and measuring prefill rates."""

from __future__ import annotations

from concurrent.futures import Future

import grpc
import pytest

from pdcluster.v1 import worker_pb2
from router.breaker import BreakerConfig, CircuitBreaker, Outcome, classify
from router.load import LoadTracker, PrefillRates
from router.placement import Placer
from router.policy import LeastLoaded, NoWorkerError, RequestContext, Signals
from router.watch import watched_channel
from serving.metrics import ProcessMetrics
from serving.registry import WorkerInfo, WorkerLoadSnapshot
from serving.rpc import MarkHandlerStatus
from serving.security import Plane, SecurityConfig, make_server

C = grpc.StatusCode


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Probes:
    """Records probes; the test resolves them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Future]] = []

    def __call__(self, address: str) -> Future:
        fut: Future = Future()
        self.calls.append((address, fut))
        return fut


def _breaker(failures: int = 3, cooldown_s: float = 5.0):
    clock, probes = Clock(), Probes()
    metrics = ProcessMetrics("router", "router", "m")
    return CircuitBreaker(BreakerConfig(failures=failures, cooldown_s=cooldown_s), probes, metrics, clock), \
        clock, probes, metrics


def _trips(metrics: ProcessMetrics, worker: str) -> float:
    return metrics.registry.get_sample_value("pdcluster:circuit_breaker_trips_total",
                                             {"role": "router", "worker_id": "router", "model_name": "m",
                                              "target_worker": worker}) or 0.0


def test_classify():
    assert classify(C.OK, False) is Outcome.SUCCESS and classify(C.OK, True) is Outcome.SUCCESS
    for code in (C.UNAVAILABLE, C.DEADLINE_EXCEEDED, C.INTERNAL, C.UNKNOWN):
        assert classify(code, from_handler=False) is Outcome.FAILURE
    for code in (C.UNAVAILABLE, C.DEADLINE_EXCEEDED, C.UNKNOWN, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED):
        assert classify(code, from_handler=True) is Outcome.NEUTRAL  # the worker answered
    # a failed model step (the worker's handler says INTERNAL) is the worker's fault: it counts
    assert classify(C.INTERNAL, from_handler=True) is Outcome.FAILURE
    for code in (C.INVALID_ARGUMENT, C.CANCELLED, C.RESOURCE_EXHAUSTED, C.ALREADY_EXISTS, C.UNAUTHENTICATED):
        assert classify(code, from_handler=False) is Outcome.NEUTRAL


def test_config_is_validated():
    for bad in ({"failures": 0}, {"cooldown_s": 0}, {"probe_timeout_s": -1}, {"ping_s": 0}):
        with pytest.raises(ValueError, match="breaker"):
            BreakerConfig(**bad)


def test_failures_open_success_resets_neutral_ignored():
    b, clock, probes, metrics = _breaker()
    assert b.allows("a:1", "decode-0")
    b.record("a:1", Outcome.FAILURE)
    b.record("a:1", Outcome.FAILURE)
    b.record("a:1", Outcome.SUCCESS)  # resets the count
    for _ in range(200):
        b.record("a:1", Outcome.NEUTRAL)
    b.record("a:1", Outcome.FAILURE)
    b.record("a:1", Outcome.FAILURE)
    assert b.allows("a:1") and b.state("a:1") == "closed"
    b.record("a:1", Outcome.FAILURE, "UNAVAILABLE: connection refused")
    assert b.state("a:1") == "open" and not b.allows("a:1") and b.num_open() == 1
    assert b.allows("b:2")  # others unaffected
    b.record("a:1", Outcome.FAILURE)  # still open: one trip only
    assert _trips(metrics, "decode-0") == 1
    assert metrics.get("circuit_breaker_open_workers")._value.get() == 1
    assert probes.calls == []


def test_cooldown_then_one_probe_success_closes():
    b, clock, probes, metrics = _breaker(failures=2, cooldown_s=5.0)
    b.record("a:1", Outcome.FAILURE)
    b.record("a:1", Outcome.FAILURE)
    clock.t += 4.9
    assert not b.allows("a:1") and probes.calls == []
    clock.t += 0.2
    assert not b.allows("a:1")  # the probe starts; still skipped until it answers
    assert not b.allows("a:1") and len(probes.calls) == 1 and b.state("a:1") == "probing"
    probes.calls[0][1].set_result(True)
    assert b.state("a:1") == "closed" and b.allows("a:1") and b.num_open() == 0
    assert metrics.get("circuit_breaker_open_workers")._value.get() == 0
    b.record("a:1", Outcome.FAILURE)  # the count starts from zero again
    assert b.allows("a:1")


@pytest.mark.parametrize("answer", ["not serving", "error"])
def test_failed_probe_reopens_for_another_cooldown(answer):
    b, clock, probes, _ = _breaker(failures=1, cooldown_s=5.0)
    b.record("a:1", Outcome.FAILURE)
    clock.t += 5.0
    assert not b.allows("a:1")
    fut = probes.calls[0][1]
    fut.set_result(False) if answer == "not serving" else fut.set_exception(grpc.RpcError())
    assert b.state("a:1") == "open"
    clock.t += 4.0
    assert not b.allows("a:1") and len(probes.calls) == 1
    clock.t += 1.0
    assert not b.allows("a:1") and len(probes.calls) == 2


def test_a_late_success_closes_an_open_breaker():
    b, clock, probes, _ = _breaker(failures=1)
    b.record("a:1", Outcome.FAILURE)
    b.record("a:1", Outcome.SUCCESS)  # a stream opened before the trip finished fine
    assert b.state("a:1") == "closed" and b.allows("a:1")


def test_a_worker_gone_from_the_registry_is_forgotten():
    """A dead worker's replacement comes back at a new address: the old address's open breaker is dropped
    (nothing would ever probe it) and the open-workers gauge falls back."""
    b, _, _, metrics = _breaker(failures=1)
    b.record("old:1", Outcome.FAILURE)
    b.record("other:1", Outcome.FAILURE)
    labels = {"role": "router", "worker_id": "router", "model_name": "m"}
    assert metrics.registry.get_sample_value("pdcluster:circuit_breaker_open_workers", labels) == 2
    b.retain({"other:1", "new:1"})
    assert b.state("old:1") == "closed" and b.state("other:1") == "open" and b.num_open() == 1
    assert metrics.registry.get_sample_value("pdcluster:circuit_breaker_open_workers", labels) == 1


def _cand(wid: str, address: str) -> tuple[WorkerInfo, WorkerLoadSnapshot]:
    return WorkerInfo(wid, "decode", address), WorkerLoadSnapshot(num_free_blocks=10)


class _View:
    def __init__(self, *cands):
        self.cands = list(cands)

    def workers(self, role=None):
        return [c for c in self.cands if role is None or c[0].role == role]

    workers_now = workers


def test_placement_skips_open_workers_before_the_policy():
    b, clock, probes, _ = _breaker(failures=1)
    prefill = (WorkerInfo("p-0", "prefill", "p:1"), WorkerLoadSnapshot())
    placer = Placer(_View(prefill, _cand("d-0", "d:0"), _cand("d-1", "d:1")), LeastLoaded(Signals(LoadTracker())), b)
    req = RequestContext("r", [1, 2, 3])
    assert placer.place(req).decode.worker_id == "d-0"  # least loaded: lowest id on a tie
    b.record("d:0", Outcome.FAILURE)
    assert placer.place(req).decode.worker_id == "d-1"
    b.record("d:1", Outcome.FAILURE)
    with pytest.raises(NoWorkerError, match="2 skipped by the circuit breaker"):
        placer.place(req)


class _Worker:
    """A real gRPC server whose handler ends with the status the test asks for (as a worker's
    handler does, with the worker's status mark)."""

    def __init__(self, code: grpc.StatusCode) -> None:
        def prefill(request, context):
            if code != C.OK:
                context.abort(code, "the handler said so")
            return worker_pb2.PrefillResponse(cached_prompt_tokens=16)

        self.server = make_server(SecurityConfig(), Plane.INTERNAL, max_workers=2, interceptors=[MarkHandlerStatus()])
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdcluster.v1.PrefillWorker", {
            "Prefill": grpc.unary_unary_rpc_method_handler(
                prefill, request_deserializer=worker_pb2.PrefillRequest.FromString,
                response_serializer=worker_pb2.PrefillResponse.SerializeToString)}),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


def _prefill(channel, tokens: int = 64):
    from pdcluster.v1 import worker_pb2_grpc

    req = worker_pb2.PrefillRequest(request=worker_pb2.WorkerRequest(request_id="r", prompt_token_ids=[5] * tokens))
    return worker_pb2_grpc.PrefillWorkerStub(channel).Prefill.future(req, timeout=5)


def test_interceptor_tells_worker_statuses_from_transport_failures():
    b, clock, probes, metrics = _breaker(failures=2)
    rates = PrefillRates()
    refusing = _Worker(C.INVALID_ARGUMENT)  # the worker answered: never its fault
    failing = _Worker(C.INTERNAL)  # the worker's handler says its model step failed: its fault
    ok = _Worker(C.OK)
    try:
        for w, state in ((refusing, "closed"), (failing, "open")):
            channel = watched_channel(grpc.insecure_channel(w.address), w.address, b, rates)
            for _ in range(5):
                with pytest.raises(grpc.RpcError):
                    _prefill(channel).result()
            assert b.state(w.address) == state
        channel = watched_channel(grpc.insecure_channel(ok.address), ok.address, b, rates)
        assert _prefill(channel).result().cached_prompt_tokens == 16
        assert rates.rate(ok.address) > 0  # 48 uncached tokens over the call's time
        dead = "127.0.0.1:1"  # nothing listens: connection refused, no handler status
        channel = watched_channel(grpc.insecure_channel(dead), dead, b, rates)
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as exc:
                _prefill(channel).result()
            assert exc.value.code() == C.UNAVAILABLE
        assert b.state(dead) == "open"
    finally:
        for w in (refusing, failing, ok):
            w.server.stop(None)


def test_prefill_rate_counts_busy_time_once_for_overlapping_calls():
    clock = Clock()
    rates = PrefillRates(horizon_s=100.0, clock=clock)
    assert rates.rate("p") is None
    for _ in range(4):
        rates.started("p")  # a batch of 4 sent together
    clock.t += 1.0
    for _ in range(4):
        rates.finished("p", 500)  # done together: 2000 tokens in 1 busy second
    assert rates.rate("p") == pytest.approx(2000.0, rel=0.01)
    clock.t += 10.0  # idle time does not count
    rates.started("p")
    clock.t += 1.0
    rates.finished("p", 0)  # a failed call: busy, no tokens
    assert rates.rate("p") == pytest.approx(1000.0, rel=0.02)
    recent = PrefillRates(horizon_s=10.0, clock=clock)  # old work fades over the horizon
    recent.started("q")
    clock.t += 1.0
    recent.finished("q", 10_000)
    for _ in range(60):
        recent.started("q")
        clock.t += 1.0
        recent.finished("q", 100)
    assert recent.rate("q") == pytest.approx(100.0, rel=0.12)  # a slight over-estimate: see PrefillRates
