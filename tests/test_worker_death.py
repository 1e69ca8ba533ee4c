"""A 2 prefill + 2 decode cluster with request migration off (``--max-migrations 0``):
cache-aware routing sends a repeated prompt to the prefill worker holding its prefix;
killing a worker ends its in-flight requests with UNAVAILABLE (no hang), the router stops
choosing it within 2 heartbeat intervals, and nothing leaks elsewhere. (With migration on,
the default, those requests resume on the other workers: ``tests/test_e2e_migration.py``.)"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from serving.registry import WorkerRegistry

from cluster_utils import assert_no_leak, router_client, running_cluster, worker_loads

HEARTBEAT_S = 0.5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--prefill", "2", "--decode", "2",
                         "--max-model-len", "1024", "--num-kv-blocks", "400",
                         "--heartbeat-s", str(HEARTBEAT_S), "--max-migrations", "0") as state:
        yield state


@pytest.fixture(scope="module")
def client(cluster):
    with router_client(cluster, timeout_s=120) as c:
        yield c


def _kill(cluster: dict, worker_id: str) -> None:
    os.kill(_pid(cluster, worker_id), signal.SIGKILL)


def _live(cluster: dict) -> set[tuple[str, int]]:
    """``(worker_id, pid)`` of every live registered process: Ray restarts a killed worker under
    the same id, so the killed process is told from its replacement by its pid."""
    return {(w.worker_id, w.pid) for w, _ in WorkerRegistry(cluster["redis_url"], cluster["cluster"]).live_workers()}


def _pid(cluster: dict, worker_id: str) -> int:
    return next(w["pid"] for w in cluster["workers"] if w["worker_id"] == worker_id)


def _wait_unlisted(cluster: dict, worker_id: str, t_kill: float, within_s: float) -> None:
    """The killed process of ``worker_id`` leaves the registry within ``within_s`` of ``t_kill``."""
    killed = (worker_id, _pid(cluster, worker_id))
    while killed in _live(cluster):
        assert time.monotonic() - t_kill < within_s, f"dead worker {worker_id} still listed"
        time.sleep(0.05)


def _expect_unavailable(fn) -> float:
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as exc:
        fn()
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value
    return time.monotonic() - t0


def test_cache_aware_routing_finds_the_cached_prefix(cluster, client):
    for i in range(4):
        prompt = [1000 + 37 * i + j for j in range(100)]  # 6 full blocks of 16
        assert client.generate(prompt, max_tokens=2, temperature=0).usage.cached_prompt_tokens == 0
        time.sleep(3 * HEARTBEAT_S)  # the worker publishes its blocks, the router reads them
        again = client.generate(prompt, max_tokens=2, temperature=0)
        assert again.usage.cached_prompt_tokens == 96, f"prompt {i} missed the worker holding its prefix"
    assert_no_leak(cluster)


def test_kill_decode_worker_mid_stream(cluster, client):
    stream = client.stream("Write a very long essay about rivers.", max_tokens=600, temperature=0,
                           ignore_eos=True)
    it = iter(stream)
    next(it)
    victim = next(w.worker_id for w in worker_loads(cluster) if w.role == "decode" and w.num_running)
    _kill(cluster, victim)
    t_kill = time.monotonic()
    elapsed = _expect_unavailable(lambda: list(it))
    assert elapsed < 5.0
    # the registry (and so the router) drops it within 2 heartbeat intervals
    _wait_unlisted(cluster, victim, t_kill, 2 * HEARTBEAT_S)
    time.sleep(0.3)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: client.generate(f"Say {i}.", max_tokens=4, temperature=0), range(6)))
    assert all(r.usage.completion_tokens == 4 for r in results)
    assert_no_leak(cluster)


def test_kill_prefill_worker_with_requests_in_flight(cluster, client):
    prefills = [w["worker_id"] for w in cluster["workers"] if w["role"] == "prefill"]
    victim = prefills[0]
    long_prompt = [17] * 900

    def send():
        try:
            return client.generate(long_prompt, max_tokens=4, temperature=0), time.monotonic()
        except grpc.RpcError as e:
            return e, time.monotonic()

    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(send) for _ in range(8)]
        deadline = time.monotonic() + 10
        while not any(w.worker_id == victim and (w.num_running or w.num_waiting) for w in worker_loads(cluster)):
            assert time.monotonic() < deadline, "victim prefill worker never got work"
            time.sleep(0.01)
        _kill(cluster, victim)
        t_kill = time.monotonic()
        # watched while the requests run: once they end, Ray may have restarted the worker
        _wait_unlisted(cluster, victim, t_kill, 2 * HEARTBEAT_S + 1.0)
        done = [f.result(timeout=60) for f in futs]
    outcomes = [o for o, _ in done]
    errors = [(o, t) for o, t in done if isinstance(o, grpc.RpcError)]
    assert errors, "no request was in flight on the killed prefill worker"
    assert all(e.code() == grpc.StatusCode.UNAVAILABLE for e, _ in errors), [e.code() for e, _ in errors]
    assert max(t for _, t in errors) - t_kill < 5.0, "a request on the dead prefill worker hung"
    assert all(o.usage.completion_tokens == 4 for o in outcomes if not isinstance(o, grpc.RpcError))
    res = client.generate("Hello there", max_tokens=3, temperature=0)
    assert res.usage.completion_tokens == 3
    assert_no_leak(cluster)
