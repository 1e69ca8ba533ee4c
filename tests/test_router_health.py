"""Router health follows the workers: gRPC health and ``GET /health`` say NOT_SERVING / 503 (naming
the missing role) while no live prefill or no live decode worker exists, SERVING / 200 once both
do, and NOT_SERVING again after the decode worker leaves. Real Redis, workers and router in
this process."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_worker.worker import create_decode_worker
from deploy.redis_server import LocalRedisServer
from engine.config import CacheConfig, SchedulerConfig
from engine.model_loader import resolve_model
from prefill_worker.worker import create_prefill_worker
from router.server import RouterConfig, RouterServer
from serving.worker_config import WorkerConfig

MODEL = "smollm2-135m-instruct"


def _http(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait(check, want, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while (got := check()) != want:
        assert time.monotonic() < deadline, f"got {got}, want {want}"
        time.sleep(0.1)


def test_health_follows_live_workers(tmp_path):
    redis = LocalRedisServer(tmp_path / "redis").start()
    base = dict(model=MODEL, redis_url=redis.url, cluster="health", heartbeat_s=0.3,
                cache=CacheConfig(block_size=16, num_blocks=64), scheduler=SchedulerConfig(max_model_len=256))
    router = RouterServer(RouterConfig(model=MODEL, model_path=str(resolve_model(MODEL)), redis_url=redis.url,
                                       cluster="health", port=0, http_port=0, max_model_len=256, view_period_s=0.1))
    hosts = []
    try:
        address = router.start()
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))

        def grpc_status():
            return stub.Check(health_pb2.HealthCheckRequest(service="pdcluster.v1.Router"), timeout=5).status

        url = f"http://{router.http_address}/health"
        _wait(grpc_status, health_pb2.HealthCheckResponse.NOT_SERVING)
        status, body = _http(url)
        assert status == 503 and "no live prefill or decode worker" in body["error"]["message"]
        hosts.append(create_prefill_worker(WorkerConfig(role="prefill", worker_id="prefill-0", **base)))
        hosts[-1].start()
        _wait(lambda: _http(url)[1].get("error", {}).get("message"), "no live decode worker")
        assert grpc_status() == health_pb2.HealthCheckResponse.NOT_SERVING
        req = urllib.request.Request(f"http://{router.http_address}/v1/completions", headers={
            "content-type": "application/json"}, data=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode())
        try:  # a new request: 503 with a retry hint (the controller replaces a dead worker within seconds)
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("served without a decode worker")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and e.headers["Retry-After"] == "1" and e.headers["retry-after-ms"] == "1000"
            assert json.loads(e.read())["error"]["message"] == "no live decode worker"
        hosts.append(create_decode_worker(WorkerConfig(role="decode", worker_id="decode-0", **base)))
        hosts[-1].start()
        _wait(grpc_status, health_pb2.HealthCheckResponse.SERVING)
        assert _http(url)[0] == 200
        hosts.pop().stop()  # the decode worker deregisters
        _wait(grpc_status, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert _http(url)[0] == 503
    finally:
        router.stop()
        for h in hosts:
            h.stop()
        redis.stop()
