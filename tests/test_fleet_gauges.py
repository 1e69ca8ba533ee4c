"""The router's fleet gauges (:mod:`router.fleet`) against a real Redis: live workers by role from
the view, desired workers and restarts from the controller's report, removed when the report
expires (a cluster nothing heals is then ``absent(pdcluster:workers_desired)``)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from deploy.redis_server import LocalRedisServer
from router.fleet import FleetGauges
from serving.metrics import ProcessMetrics
from serving.registry import CONTROLLER_REPORT_KEY, WorkerInfo, WorkerRegistry


@pytest.fixture
def redis_url(tmp_path):
    srv = LocalRedisServer(tmp_path / "redis").start(timeout_s=10.0)
    yield srv.url
    srv.stop()


def _series(metrics: ProcessMetrics, name: str) -> dict[str, float]:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(f"pdcluster:{name}{{"):
            labels, value = line[len(name) + 11:].rsplit("} ", 1)
            key = [kv.split("=")[1].strip('"') for kv in labels.split(",") if kv.split("=")[0] in
                   ("worker_role", "target_worker")][0]
            out[key] = float(value)
    return out


def _info(worker_id: str, role: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address="127.0.0.1:1", pid=1)


def test_live_desired_and_restarts_follow_the_report(redis_url):
    reg = WorkerRegistry(redis_url, "fleet")
    metrics = ProcessMetrics("router", "router-0", "m")
    live = [_info("prefill-0", "prefill"), _info("decode-0", "decode")]
    fleet = FleetGauges(metrics, lambda: live, WorkerRegistry(redis_url, "fleet"))
    try:
        fleet.update()
        assert _series(metrics, "workers_live") == {"prefill": 1, "decode": 1, "colocated": 0}
        assert _series(metrics, "workers_desired") == {} and _series(metrics, "worker_restarts") == {}
        reg.put_state(CONTROLLER_REPORT_KEY, {"desired": {"prefill": 1, "decode": 2},
                                              "workers": [{"worker_id": "prefill-0", "restarts": 0},
                                                          {"worker_id": "decode-0", "restarts": 0},
                                                          {"worker_id": "decode-1", "restarts": 3}]})
        fleet.update()
        assert _series(metrics, "workers_desired") == {"prefill": 1, "decode": 2, "colocated": 0}
        assert _series(metrics, "worker_restarts") == {"prefill-0": 0, "decode-0": 0, "decode-1": 3}
        reg.put_state(CONTROLLER_REPORT_KEY, {"desired": {"prefill": 1, "decode": 1},
                                              "workers": [{"worker_id": "prefill-0", "restarts": 0},
                                                          {"worker_id": "decode-0", "restarts": 1}]})
        fleet.update()  # scaled down: decode-1's series goes with it
        assert _series(metrics, "worker_restarts") == {"prefill-0": 0, "decode-0": 1}
        reg._r.delete(f"{reg.prefix}state:{CONTROLLER_REPORT_KEY}")  # the report expired: no controller
        fleet.update()
        assert _series(metrics, "workers_desired") == {} and _series(metrics, "worker_restarts") == {}
        assert _series(metrics, "workers_live") == {"prefill": 1, "decode": 1, "colocated": 0}
    finally:
        fleet.close()
        reg.close()
