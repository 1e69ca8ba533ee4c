"""The parts of ``--routers N`` that need no cluster: router records in a real Redis, the peers'
view, admission's share, SO_REUSEPORT listening sockets and the router's private ``/metrics``."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from deploy.redis_server import LocalRedisServer
from router.admission import Admission, AdmissionConfig
from router.http import reuse_port_socket
from router.load import LoadTracker, PrefillRates
from router.peers import RouterPeers
from serving.metrics import ProcessMetrics
from serving.metrics_http import MetricsHttpServer
from serving.registry import RouterRecord, WorkerInfo, WorkerLoadSnapshot, WorkerRegistry


@pytest.fixture
def redis_url(tmp_path):
    srv = LocalRedisServer(tmp_path / "redis").start(timeout_s=10.0)
    yield srv.url
    srv.stop()


def test_router_records_expire_and_are_listed_by_index(redis_url):
    reg = WorkerRegistry(redis_url, "c")
    reg.put_state("router-ports", {"port": 1, "http_port": 2})  # another key of the same prefix
    reg.put_router(RouterRecord(1, 11, "h:1", "h:9"), ttl_s=0.3)
    reg.put_router(RouterRecord(0, 10, "h:1", "h:8"), ttl_s=30)
    assert [(r.router_id, r.pid) for r in reg.live_routers()] == [("router-0", 10), ("router-1", 11)]
    time.sleep(0.5)
    assert [r.index for r in reg.live_routers()] == [0]
    reg.remove_router(0)
    assert reg.live_routers() == []
    reg.close()


def test_a_wrong_typed_router_or_load_record_is_skipped_not_fatal(redis_url):
    """One router record with a string index (anyone with the Redis password can write one) made the
    sort by index raise: the router's peers thread died and the router crash-looped."""
    import redis

    reg = WorkerRegistry(redis_url, "c")
    reg.put_router(RouterRecord(0, 10, "h:1", "h:8"), ttl_s=30)
    raw = redis.Redis.from_url(redis_url)
    raw.set("pdcluster:c:router:evil", json.dumps({"index": "evil", "pid": 1, "address": "x", "metrics_address": "y"}))
    raw.set("pdcluster:c:router:bool", json.dumps({"index": True, "pid": 1, "address": "x", "metrics_address": "y"}))
    raw.set("pdcluster:c:router:short", json.dumps({"index": 3}))
    raw.set("pdcluster:c:router:list", "[1, 2]")
    raw.set("pdcluster:c:router:bytes", b"\xff\xfenot json")  # not UTF-8: failed the whole MGET reply
    assert [r.index for r in reg.live_routers()] == [0]
    # workers: a heartbeat that is not UTF-8, and an info key of the wrong Redis type, fail their own entry only
    reg.register(WorkerInfo("w-ok", "decode", "h:1"), ttl_s=30)
    reg.heartbeat("w-ok", WorkerLoadSnapshot(), ttl_s=30)
    raw.sadd("pdcluster:c:workers", "w-bytes", "w-type")
    raw.hset("pdcluster:c:worker:w-bytes:info", mapping={"worker_id": "w-bytes", "role": "decode", "address": "h:2"})
    raw.set("pdcluster:c:worker:w-bytes:hb", b"\xff{")
    raw.set("pdcluster:c:worker:w-type:info", "not a hash")
    raw.set("pdcluster:c:worker:w-type:hb", WorkerLoadSnapshot().to_json())
    assert [info.worker_id for info, _ in reg.live_workers()] == ["w-ok"]
    with pytest.raises(TypeError, match="num_free_blocks must be int"):
        WorkerLoadSnapshot.from_json('{"num_free_blocks": "7"}')
    assert WorkerLoadSnapshot.from_json('{"updated_at": 3, "extra": 1}').updated_at == 3
    raw.close()
    reg.close()


def test_peers_publish_and_see_each_other(redis_url):
    a = RouterPeers(WorkerRegistry(redis_url, "c"), lambda: RouterRecord(0, 1, "h:1", "h:8"), period_s=0.1)
    b = RouterPeers(WorkerRegistry(redis_url, "c"), lambda: RouterRecord(1, 2, "h:1", "h:9"), period_s=0.1)
    a.start()
    b.start()
    deadline = time.monotonic() + 5
    while a.count() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r.metrics_address for r in a.live()] == ["h:8", "h:9"] and b.count() == 2
    b.stop()  # removes its record at once
    a.refresh()
    assert a.count() == 1
    a.stop()
    with pytest.raises(ValueError):
        RouterPeers(WorkerRegistry(redis_url, "c"), lambda: RouterRecord(0, 1, "", ""), period_s=0.1, ttl_periods=1)


def test_admission_divides_the_capacity_over_live_routers():
    decodes = [WorkerInfo("d-0", "decode", "d:0", max_num_seqs=4), WorkerInfo("d-1", "decode", "d:1", max_num_seqs=4)]
    routers = [1]
    adm = Admission(AdmissionConfig(max_queued_requests=11), lambda: decodes, lambda: [], LoadTracker(),
                    PrefillRates(), lambda w, p: 0, ProcessMetrics("router", "router-0", "m"), lambda: routers[0])
    assert adm.capacity() == 19
    routers[0] = 2
    assert adm.capacity() == 10  # ceil(19 / 2)
    assert "shared by 2 router(s)" in adm.queue_full("r", 10, adm.room()).message


def test_reuse_port_sockets_share_a_port():
    first = reuse_port_socket("127.0.0.1", 0)
    first.listen()
    port = first.getsockname()[1]
    second = reuse_port_socket("127.0.0.1", port)
    second.listen()
    plain = socket.socket()
    with pytest.raises(OSError):  # a socket without SO_REUSEPORT cannot join
        plain.bind(("127.0.0.1", port))
    for s in (first, second, plain):
        s.close()


def test_private_metrics_ask_for_the_api_key():
    metrics = ProcessMetrics("router", "router-3", "m")
    server = MetricsHttpServer(metrics.registry, "127.0.0.1", lambda key: key == "k1")
    address = server.start()
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://{address}/metrics", timeout=5)
        assert refused.value.code == 401
        req = urllib.request.Request(f"http://{address}/metrics", headers={"Authorization": "Bearer k1"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert b'worker_id="router-3"' in r.read()
    finally:
        server.stop()
