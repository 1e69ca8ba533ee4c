"""Admission control without a cluster: capacity from the decode workers' published seats plus
``max_queued_requests``, refusals before validation and before anything is registered, the
TTFT-SLO prediction from measured prefill rates, the retry-after hint on both front doors
(gRPC ``retry-after-ms`` trailing metadata; HTTP 429 with ``Retry-After`` and an OpenAI error
body), the configs' validation and ``pdcluster up``'s flags."""

from __future__ import annotations

import threading
import time
import types

import grpc
import pytest
from fastapi.testclient import TestClient

from deploy.spec import spec_from_args
from pdcluster.client import build_request
from pdcluster.v1 import router_pb2, router_pb2_grpc, worker_pb2
from router.admission import Admission, AdmissionConfig
from router.breaker import BreakerConfig
from router.core import RequestRouter
from router.errors import RouterError
from router.load import LoadTracker, PrefillRates
from router.openai.app import FrontDoorState, build_app
from router.service import RouterServicer, add_router_service
from serving.metrics import ProcessMetrics
from serving.registry import WorkerInfo
from serving.rpc import RETRY_AFTER_METADATA
from serving.security import Plane, SecurityConfig, make_server

from cli_helpers import parse_up

DECODES = [WorkerInfo("d-0", "decode", "d:0", max_num_seqs=4), WorkerInfo("d-1", "decode", "d:1", max_num_seqs=4)]
PREFILLS = [WorkerInfo("p-0", "prefill", "p:0"), WorkerInfo("p-1", "prefill", "p:1")]


def _rejected(metrics: ProcessMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("pdcluster:num_requests_rejected_total", {
        "role": "router", "worker_id": "router", "model_name": "m", "reason": reason}) or 0.0


def _admission(cfg: AdmissionConfig, load=None, rates=None, cached=lambda w, p: 0):
    metrics = ProcessMetrics("router", "router", "m")
    adm = Admission(cfg, lambda: DECODES, lambda: PREFILLS, load or LoadTracker(), rates or PrefillRates(), cached,
                    metrics)
    return adm, metrics


def test_configs_are_validated():
    for bad in ({"max_queued_requests": -1}, {"ttft_slo_ms": 0}, {"max_admitted_requests": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AdmissionConfig(**bad)


def test_capacity_is_the_seats_plus_the_queue_capped():
    adm, _ = _admission(AdmissionConfig(max_queued_requests=10))
    assert adm.seats() == 8 and adm.capacity() == 18
    assert _admission(AdmissionConfig(max_queued_requests=10, max_admitted_requests=12))[0].capacity() == 12


def test_queue_full_hint_follows_the_time_requests_stay():
    adm, metrics = _admission(AdmissionConfig(max_queued_requests=10))
    refused = adm.queue_full("r-1", 18, adm.room())
    assert refused.reason == "queue_full" and refused.retry_after_ms == 1000  # nothing measured yet
    assert "it holds 18 requests (running, queued or being admitted), capacity 18" in refused.message
    adm.left(4.0)  # 4 s in the router, 8 seats: a seat frees every 0.5 s
    assert adm.queue_full("r-2", 18, adm.room()).retry_after_ms == 500
    assert _rejected(metrics, "queue_full") == 2


class _Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_ttft_prediction_uses_the_best_prefill_worker():
    clock = _Clock()
    rates, load = PrefillRates(horizon_s=1000.0, clock=clock), LoadTracker()
    for address, tokens in (("p:0", 1000), ("p:1", 4000)):  # p-0: 1000 tok/s, p-1: 4000 tok/s
        rates.started(address)
        clock.t += 1.0
        rates.finished(address, tokens)
    load.begin("p-1", "d-0", 6000)  # 6000 tokens queued at the fast one
    adm, metrics = _admission(AdmissionConfig(ttft_slo_ms=2000), load, rates,
                              cached=lambda w, p: 500 if w.worker_id == "p-0" else 0)
    prompt = [1] * 1500
    # p-0: 1000 uncached / 1000 = 1.0 s; p-1: (6000 + 1500) / 4000 = 1.875 s
    assert adm.predicted_ttft_ms(prompt) == pytest.approx(1000, rel=0.1)
    adm.check_ttft("ok", prompt)
    with pytest.raises(Exception) as exc:
        adm.check_ttft("slow", [1] * 3500)  # p-0: 3.0 s, p-1: 2.375 s > 2 s
    assert exc.value.reason == "ttft_slo" and "predicted time to first token" in exc.value.message
    assert exc.value.retry_after_ms == pytest.approx(375, abs=40)
    assert _rejected(metrics, "ttft_slo") == 1
    assert _admission(AdmissionConfig(ttft_slo_ms=1))[0].predicted_ttft_ms(prompt) is None  # nothing measured


class _Validator:
    def __init__(self):
        self.seen = 0

    def prepare(self, request):
        self.seen += 1
        return types.SimpleNamespace(request_id=request.request_id or "minted", prompt_token_ids=[1, 2, 3],
                                     worker_request=worker_pb2.WorkerRequest())


def test_the_router_refuses_before_validating_and_holds_nothing():
    adm, metrics = _admission(AdmissionConfig(max_queued_requests=1))  # capacity 9
    validator = _Validator()
    core = RequestRouter(validator, None, None, LoadTracker(), metrics, None, adm)
    admitted = [core.start(router_pb2.GenerateRequest(request_id=f"r{i}", text="x")) for i in range(9)]
    with pytest.raises(RouterError) as exc:
        core.start(router_pb2.GenerateRequest(request_id="r9", text="x"))
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.value.retry_after_ms == 1000
    assert validator.seen == 9 and len(core._table) == 9 and "r9" not in core._table
    admitted[0].discard()  # one leaves: one more fits
    core.start(router_pb2.GenerateRequest(request_id="r9", text="x"))
    assert _rejected(metrics, "queue_full") == 1


def test_a_call_cancelled_before_placement_is_forgotten_and_counted():
    """gRPC runs no callback a terminated call is given: the request leaves at once, counted
    CANCELLED (every request counts once in request_success or request_errors)."""
    adm, metrics = _admission(AdmissionConfig(max_queued_requests=1))
    core = RequestRouter(_Validator(), None, None, LoadTracker(), metrics, None, adm)
    context = types.SimpleNamespace(add_callback=lambda callback: False, invocation_metadata=lambda: ())
    servicer = RouterServicer(core, router_pb2.ModelInfo(model_name="m"))
    assert list(servicer.Generate(router_pb2.GenerateRequest(request_id="gone", text="x"), context)) == []
    assert "gone" not in core._table and metrics.get("request_errors", code="CANCELLED")._value.get() == 1


class _BlockingValidator(_Validator):
    """Holds request "slow" inside its start (tokenizing) until ``release`` is set."""

    def __init__(self):
        super().__init__()
        self.inside, self.release = threading.Event(), threading.Event()

    def prepare(self, request):
        if request.request_id == "slow":
            self.inside.set()
            assert self.release.wait(10)
        return super().prepare(request)


def test_a_request_being_validated_holds_its_seat_and_refusals_do_not_wait_for_it():
    """While an admitted request is being validated (tokenized), the one that fills the router
    is refused at once, not after it; a start that fails frees its seat."""
    adm, metrics = _admission(AdmissionConfig(max_queued_requests=1))  # capacity 9
    validator = _BlockingValidator()
    core = RequestRouter(validator, None, None, LoadTracker(), metrics, None, adm)
    admitted = [core.start(router_pb2.GenerateRequest(request_id=f"r{i}", text="x")) for i in range(8)]
    slow = threading.Thread(target=core.start, args=(router_pb2.GenerateRequest(request_id="slow", text="x"),))
    slow.start()
    try:
        assert validator.inside.wait(10)
        t0 = time.monotonic()
        with pytest.raises(RouterError) as exc:
            core.start(router_pb2.GenerateRequest(request_id="r9", text="x"))
        assert time.monotonic() - t0 < 1.0 and exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "holds 8 requests" not in exc.value.message and "holds 9 requests" in exc.value.message
    finally:
        validator.release.set()
        slow.join(10)
    assert len(core._table) == 9 and core._starting == 0
    with pytest.raises(RouterError) as dup:  # a start that fails gives its seat back
        admitted[0].discard()
        core.start(router_pb2.GenerateRequest(request_id="slow", text="x"))
    assert dup.value.code == grpc.StatusCode.ALREADY_EXISTS and core._starting == 0 and len(core._table) == 8
    assert metrics.get("request_errors", code="ALREADY_EXISTS")._value.get() == 1  # every refusal counts


class _RefusingCore:
    admission = None

    def start(self, request, owner=""):
        raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the router is full", retry_after_ms=1500)

    def abort(self, request_id, owner=None):
        return False


def test_an_unexpected_error_while_preparing_is_internal_counted_and_frees_the_seat():
    """A bug in validation (any exception but a refusal) answers INTERNAL over gRPC and a JSON 500
    over HTTP, counted in ``request_errors``, not a raw exception (gRPC's UNKNOWN, Starlette's plain
    text 500; helper finding), and the request holds no seat afterwards."""
    class Broken(_Validator):
        def prepare(self, request):
            raise ValueError("boom")

    adm, metrics = _admission(AdmissionConfig(max_queued_requests=1))
    core = RequestRouter(Broken(), None, None, LoadTracker(), metrics, None, adm)
    with pytest.raises(RouterError) as exc:
        core.start(router_pb2.GenerateRequest(request_id="r", text="x"))
    assert exc.value.code == grpc.StatusCode.INTERNAL and "ValueError" in exc.value.message
    assert core._starting == 0 and not core._table
    state = FrontDoorState(core=core, model_name="m", tokenizer=None, health=lambda: (True, ""),
                           targets=list, metrics_registry=None, accepts_api_key=lambda key: True)
    r = TestClient(build_app(state)).post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal", r.text
    assert metrics.registry.get_sample_value("pdcluster:request_errors_total", {
        "role": "router", "worker_id": "router", "model_name": "m", "code": "INTERNAL"}) == 2


def test_grpc_refusal_carries_retry_after_ms():
    server = make_server(SecurityConfig(), Plane.PUBLIC, max_workers=2)
    add_router_service(RouterServicer(_RefusingCore(), router_pb2.ModelInfo(model_name="m")), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as exc:
                list(router_pb2_grpc.RouterStub(channel).Generate(build_request("hi"), timeout=10))
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(exc.value.trailing_metadata())[RETRY_AFTER_METADATA] == "1500"
    finally:
        server.stop(None)


def test_http_refusal_is_429_with_retry_after():
    state = FrontDoorState(core=_RefusingCore(), model_name="m", tokenizer=None, health=lambda: (True, ""),
                           targets=list, metrics_registry=None, accepts_api_key=lambda key: True)
    r = TestClient(build_app(state)).post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "2" and r.headers["retry-after-ms"] == "1500"
    assert r.json() == {"error": {"message": "the router is full", "type": "rate_limit_error", "param": None,
                                  "code": "resource_exhausted"}}


def test_http_choices_beyond_the_capacity_are_a_400_naming_n():
    """n x prompts above what the router can ever hold at once is no overload: retrying cannot help
    (helper finding: it was a 429 'retry later'); nothing is started."""
    started = []
    core = types.SimpleNamespace(admission=types.SimpleNamespace(capacity=lambda: 6), start=started.append,
                                 abort=lambda request_id: False)
    state = FrontDoorState(core=core, model_name="m", tokenizer=None, health=lambda: (True, ""),
                           targets=list, metrics_registry=None, accepts_api_key=lambda key: True)
    app = TestClient(build_app(state))
    r = app.post("/v1/completions", json={"model": "m", "prompt": "hi", "n": 7})
    assert r.status_code == 400 and not started
    assert r.json()["error"]["param"] == "n" and "7 choices (prompts x n) exceed the 6 requests" in r.json()["error"]["message"]
    r = app.post("/v1/completions", json={"model": "m", "prompt": ["a", "b", "c", "d", "e", "f", "g"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and not started


def test_up_flags_reach_the_router_and_the_workers(capsys):
    default = spec_from_args(parse_up(), "redis://127.0.0.1:1")
    assert default.router.admission == AdmissionConfig() and default.router.breaker == BreakerConfig()
    assert default.worker.max_queued_requests == AdmissionConfig().max_queued_requests
    spec = spec_from_args(parse_up("--max-queued-requests", "7", "--ttft-slo-ms", "250", "--breaker-failures", "2",
                                    "--breaker-cooldown-s", "1.5"), "redis://127.0.0.1:1")
    assert spec.router.admission == AdmissionConfig(max_queued_requests=7, ttft_slo_ms=250.0)
    assert spec.router.breaker == BreakerConfig(failures=2, cooldown_s=1.5)
    assert spec.worker.max_queued_requests == 7
    for bad in (("--max-queued-requests", "-1"), ("--ttft-slo-ms", "0"), ("--breaker-failures", "0"),
                ("--breaker-cooldown-s", "-2")):
        with pytest.raises(SystemExit):
            parse_up(*bad)
        assert "must be" in capsys.readouterr().err
