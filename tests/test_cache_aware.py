"""Cache-aware prefill routing: publication through a real Redis, read back by the policy."""

from __future__ import annotations

import time

import pytest

from common.prefix_hash import block_hashes
from deploy.redis_server import LocalRedisServer
from router.cache_aware import CacheAware, cached_prefix_tokens
from router.load import LoadTracker
from router.policy import RequestContext, Signals
from serving.cache_index import CacheIndexPublisher, CacheIndexView
from serving.registry import WorkerInfo, WorkerLoadSnapshot


@pytest.fixture
def redis_url(tmp_path):
    with LocalRedisServer(tmp_path) as server:
        yield server.url


def _cand(wid, free=10, draining=False):
    return (WorkerInfo(worker_id=wid, role="prefill", address=f"127.0.0.1:{len(wid)}"),
            WorkerLoadSnapshot(num_free_blocks=free, draining=draining))


def test_publisher_sends_differences_and_view_reads_them(redis_url):
    held: list[bytes] = []
    pub = CacheIndexPublisher(redis_url, "t", "p0", lambda: list(held), "m:float32", 16, period_s=0.05)
    view = CacheIndexView(redis_url, "t", lambda: ["p0", "p1"], period_s=0.05)
    prompt = list(range(100))
    held.extend(block_hashes(prompt, 16, "m:float32")[:3])
    pub.publish()
    view.refresh()
    meta, hashes = view.get("p0")
    assert meta == {"model_id": "m:float32", "block_size": 16} and len(hashes) == 3
    assert view.get("p1") is None
    assert cached_prefix_tokens(prompt, meta, hashes) == 48
    held.pop(1)  # block 1 evicted: only block 0 is a usable prefix now
    pub.publish()
    view.refresh()
    assert cached_prefix_tokens(prompt, *view.get("p0")) == 16
    pub.stop()
    view.refresh()
    assert view.get("p0") is None


def test_cache_aware_scores_uncached_plus_queued_tokens(redis_url):
    prompt = list(range(200, 328))  # 8 blocks of 16
    hashes = block_hashes(prompt, 16, "m")
    pubs = [CacheIndexPublisher(redis_url, "t", "warm", lambda: hashes[:6], "m", 16),
            CacheIndexPublisher(redis_url, "t", "cold", lambda: [], "m", 16)]
    for p in pubs:
        p.publish()
    view = CacheIndexView(redis_url, "t", lambda: ["warm", "cold"])
    view.refresh()
    load = LoadTracker()
    policy = CacheAware(Signals(load, view))
    request = RequestContext("r", prompt)
    cands = [_cand("cold", free=50), _cand("warm", free=5)]
    choice = policy.choose("prefill", cands, request)
    assert (choice.worker, choice.cached_tokens) == (cands[1][0], 96)
    queued = load.begin("warm", "some-decode", 100)  # 32 uncached + 100 queued > 128 uncached + 0 queued
    assert policy.choose("prefill", cands, request).worker.worker_id == "cold"
    queued.end()
    assert policy.choose("prefill", cands, request).worker.worker_id == "warm"
    draining = [_cand("cold"), _cand("warm", draining=True)]
    assert policy.choose("prefill", draining, request).worker.worker_id == "cold"
    for p in pubs:
        p.stop()


def test_publisher_thread_survives_and_expires(redis_url):
    pub = CacheIndexPublisher(redis_url, "t", "p9", lambda: [b"12345678"], "m", 16, period_s=0.05).start()
    view = CacheIndexView(redis_url, "t", lambda: ["p9"], period_s=0.05).start()
    deadline = time.monotonic() + 5
    while view.get("p9") is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    view.stop()
    pub.stop()
