"""``pdcluster status`` against a real Redis: a desired router without a live record (its process
died, or Redis restarted) is missing, as a desired worker is: listed with why (the controller's
reason when it reports one), exit status 3; a Ray head that does not answer is said to be down."""

from __future__ import annotations

import pytest

from deploy import status as cluster_status
from deploy.redis_server import LocalRedisServer
from serving.registry import CONTROLLER_REPORT_KEY, RouterRecord, WorkerRegistry


@pytest.fixture
def redis_url(tmp_path):
    srv = LocalRedisServer(tmp_path / "redis").start(timeout_s=10.0)
    yield srv.url
    srv.stop()


def test_a_router_without_a_record_is_missing(redis_url, capsys):
    state = {"redis_url": redis_url, "cluster": "st", "num_routers": 2, "workers": [],
             "router_address": "127.0.0.1:1", "ray_address": "127.0.0.1:1"}  # nothing listens on port 1
    reg = WorkerRegistry(redis_url, "st")
    try:
        reg.put_router(RouterRecord(index=0, pid=11, address="127.0.0.1:1", metrics_address="127.0.0.1:2"), 30.0)
    finally:
        reg.close()
    st = cluster_status.collect(state)
    assert [r["index"] for r in st["routers"]["live"]] == [0]
    assert [(m["worker_id"], m["role"], m["restarts"]) for m in st["missing"]] == [("router-1", "router", None)]
    assert cluster_status.print_status(state) == 3
    out = capsys.readouterr().out
    assert "1/2 routers" in out and "missing: router-1 (router): no router record" in out and "; restarts" not in out
    assert not st["ray_up"] and "Ray head at 127.0.0.1:1 does not answer: the cluster is down" in out


def test_a_missing_router_shows_the_controllers_reason(redis_url, capsys):
    state = {"redis_url": redis_url, "cluster": "st", "num_routers": 1, "workers": [],
             "router_address": "127.0.0.1:1", "ray_address": "127.0.0.1:1"}
    reg = WorkerRegistry(redis_url, "st")
    try:
        reg.put_state(CONTROLLER_REPORT_KEY, {"updated_at": 0, "workers": [], "routers": {
            "desired": 1, "live": [], "missing": {"0": {"reason": "not answering (restarting or hung) for 7s",
                                                        "restarts": 1}}}})
    finally:
        reg.close()
    st = cluster_status.collect(state)
    assert [(m["worker_id"], m["reason"], m["restarts"]) for m in st["missing"]] == [
        ("router-0", "not answering (restarting or hung) for 7s", 1)]
    assert cluster_status.print_status(state) == 3
    assert "missing: router-0 (router): not answering (restarting or hung) for 7s; restarts 1" in capsys.readouterr().out


def test_a_key_of_the_wrong_type_is_named_not_called_unreachable(redis_url, capsys):
    import redis
    state = {"redis_url": redis_url, "cluster": "st", "num_routers": 0, "workers": [],
             "router_address": "127.0.0.1:1", "ray_address": "127.0.0.1:1"}
    r = redis.Redis.from_url(redis_url)
    try:
        r.lpush(f"pdcluster:st:state:{CONTROLLER_REPORT_KEY}", "x")  # a list where pdcluster keeps a string
    finally:
        r.close()
    assert cluster_status.print_status(state) == 1
    err = capsys.readouterr().err
    assert "answered with an error (WRONGTYPE" in err and "'pdcluster:st:'" in err and "cannot reach" not in err
