"""The load-test runner alone, against a fake Router servicer on a real loopback gRPC server.

The fake's behaviour per request is chosen by the prompt's first token id, so every
outcome (success, gRPC error, hang, server abort, multi-token chunks, slow start) is
exercised deterministically; the real cluster is covered by test_loadtest_e2e.py.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from loadtest.metrics import summarize
from loadtest.runner import LoadRunner, RunConfig
from loadtest.workload import PlannedRequest
from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc
from serving.rpc import add_health, set_serving
from serving.security import Plane, SecurityConfig, bind, make_server

OK, FAIL, HANG, SLOW, ABORT, PAIRS = range(6)
GAP_S = 0.02


class FakeRouter(router_pb2_grpc.RouterServicer):
    def __init__(self):
        self.lock = threading.Lock()
        self.active = self.max_active = 0

    def Generate(self, request, context):
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            yield from self._generate(request, context)
        finally:
            with self.lock:
                self.active -= 1

    def _generate(self, request, context):
        kind, n = request.token_ids.ids[0], request.sampling.max_tokens
        assert request.sampling.ignore_eos and request.stream
        if kind == FAIL:
            yield router_pb2.GenerateResponse(request_id=request.request_id, token_ids=[7])
            context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker died")
        if kind == HANG:
            while context.is_active():
                time.sleep(0.01)
            return
        if kind == SLOW:
            time.sleep(1.0)
        if kind == ABORT:
            yield router_pb2.GenerateResponse(token_ids=[7], finish_reason=common_pb2.FINISH_REASON_ABORT)
            return
        step = 2 if kind == PAIRS else 1
        for i in range(0, n, step):
            time.sleep(GAP_S)
            last = i + step >= n
            yield router_pb2.GenerateResponse(
                token_ids=[7] * min(step, n - i),
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED)


@pytest.fixture
def fake():
    server = make_server(SecurityConfig(), Plane.PUBLIC, max_workers=32)
    health = add_health(server)
    servicer = FakeRouter()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1", 0, SecurityConfig(), Plane.PUBLIC)
    server.start()
    set_serving(health, ["pdcluster.v1.Router"])
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def _run(address, kinds, arrivals, outputs=4, **cfg):
    plan = [PlannedRequest(i, t, 3, outputs) for i, t in enumerate(arrivals)]
    runner = LoadRunner(RunConfig(address=address, ready_timeout_s=10, **cfg), plan, [[k, 1, 2] for k in kinds])
    return runner.run()


def test_every_outcome_is_recorded(fake):
    address, _ = fake
    kinds = [OK, FAIL, HANG, SLOW, ABORT, PAIRS]
    res = _run(address, kinds, [0.05 * i for i in range(6)], outputs=5, drain_timeout_s=2.0)
    status = [r.status for r in res.records]
    assert status == ["OK", "UNAVAILABLE", "CANCELLED", "OK", "ABORT", "OK"]
    assert res.sent == 6 and res.not_sent == 0 and len(res.records) == 6
    ok, fail, hang, slow, abort, pairs = res.records
    assert ok.output_tokens == 5 and ok.finish_reason == "LENGTH" and ok.ttft_s >= GAP_S
    assert fail.error == "decode worker died" and fail.output_tokens == 1
    assert slow.ttft_s >= 1.0
    assert pairs.output_tokens == 5 and pairs.itls_s[0] == 0.0  # tokens of one chunk share its time
    s = summarize(res.records, res.sent, res.duration_s)
    assert (s["completed"], s["failed"]) == (3, 3)
    assert s["errors"] == {"ABORT": 1, "CANCELLED": 1, "UNAVAILABLE": 1}
    assert 2.0 <= res.duration_s < 5.0  # the hung request was cancelled at the drain deadline


def test_open_loop_arrivals_not_delayed_by_slow_responses(fake):
    address, servicer = fake
    t0 = time.monotonic()
    res = _run(address, [SLOW] * 6, [0.1 * i for i in range(6)], outputs=1)
    assert all(r.ok for r in res.records)
    # each SLOW response takes >= 1 s: sends serialized behind them would lag by seconds; the bound
    # leaves room for thread scheduling on a loaded 2-core machine (0.49 s seen under a full test run)
    assert max(r.arrival_s - r.scheduled_s for r in res.records) < 0.75
    assert servicer.max_active >= 5  # all slow requests overlapped
    assert time.monotonic() - t0 < 4.0


def test_closed_loop_keeps_concurrency(fake):
    address, servicer = fake
    res = _run(address, [OK] * 8, [0.0] * 8, outputs=5, concurrency=2)
    assert [r.status for r in res.records] == ["OK"] * 8
    assert servicer.max_active == 2
    starts = sorted(r.arrival_s for r in res.records)
    assert starts[-1] > 3 * 5 * GAP_S  # later requests waited for earlier ones


def test_duration_limit_stops_sending(fake):
    address, _ = fake
    res = _run(address, [OK] * 4, [0.0, 0.1, 5.0, 10.0], duration_s=1.0)
    assert res.sent == 2 and res.not_sent == 2 and len(res.records) == 2


def test_run_config_validation():
    for bad in (dict(address="localhost"), dict(address="h:p"), dict(address="h:1", concurrency=0),
                dict(address="h:1", duration_s=0), dict(address="h:1", temperature=-1)):
        with pytest.raises(ValueError):
            RunConfig(**bad)
