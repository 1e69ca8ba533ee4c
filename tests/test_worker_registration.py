"""A worker that starts while the cluster's Redis does not answer (the controller restarting it,
e.g. during ``pdcluster scale``) waits for it and registers once it is back, under the next
generation, instead of failing its start (real Redis, real gRPC server; the scheduler is a
stand-in: this is a unit test of :class:`serving.worker_host.WorkerHost`)."""

from __future__ import annotations

import threading
import time

import pytest
from redis.exceptions import AuthenticationError, RedisError

from deploy.redis_server import LocalRedisServer, free_port
from serving.registry import WorkerRegistry
from serving.worker_config import WorkerConfig
from serving.worker_host import WorkerHost


class IdleScheduler:
    def run(self, stop: threading.Event) -> None:
        stop.wait()

    def load(self) -> dict:
        return {"num_waiting": 0, "num_running": 0, "num_free_blocks": 8, "num_total_blocks": 8}


def _host(url: str) -> WorkerHost:
    cfg = WorkerConfig(role="decode", worker_id="decode-7", model="m", redis_url=url, heartbeat_s=0.5)
    return WorkerHost(cfg, IdleScheduler(), lambda server: None, [])


def test_worker_registers_once_redis_is_back(tmp_path):
    port = free_port()
    redis = LocalRedisServer(tmp_path, port=port, persist=True)
    url = f"redis://127.0.0.1:{port}/0"
    redis.start()
    earlier = WorkerRegistry(url, "default")
    earlier.next_generation("decode-7")  # an earlier life: generation 1
    earlier.close()
    redis.stop()
    starter = threading.Timer(1.5, redis.start)  # Redis back 1.5 s after the worker started
    starter.start()
    host = _host(url)
    try:
        t0 = time.monotonic()
        host.start()
        assert time.monotonic() - t0 >= 1.0  # it waited for Redis
        reg = WorkerRegistry(url, "default")
        live = {info.worker_id: info for info, _ in reg.live_workers()}
        reg.close()
        assert live["decode-7"].generation == 2  # the counter came back with Redis' append-only file
    finally:
        starter.join()
        host.stop()
        redis.stop()


def test_worker_start_fails_when_redis_stays_down(tmp_path):
    host = _host(f"redis://127.0.0.1:{free_port()}/0")
    try:
        with pytest.raises(RedisError):
            host._register(wait_s=1.0)
    finally:
        host.server.stop(0).wait()


def test_worker_start_fails_at_once_on_a_wrong_password(tmp_path):
    with LocalRedisServer(tmp_path, password="right") as redis:
        host = _host(f"redis://:wrong@127.0.0.1:{redis.port}/0")
        try:
            t0 = time.monotonic()
            with pytest.raises(AuthenticationError):
                host._register(wait_s=20.0)
            assert time.monotonic() - t0 < 5.0  # not retried: a wrong password does not heal
        finally:
            host.server.stop(0).wait()
