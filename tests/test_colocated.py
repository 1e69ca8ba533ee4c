"""Colocated worker (prefill + decode on one engine): token-exact, in-place KV, no leaks.

Runs the real servers in this process (real Redis, real gRPC on loopback, no Ray);
deployment through ``pdcluster up --colocated`` is covered by the deploy tests.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from colocated_worker.worker import create_colocated_worker
from deploy.redis_server import LocalRedisServer
from engine.config import CacheConfig, SchedulerConfig
from engine.model_loader import resolve_model
from pdcluster.client import PdclusterClient
from router.server import RouterConfig, RouterServer
from serving.worker_config import WorkerConfig

from cluster_utils import assert_greedy_matches, hf_greedy, render_chat


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    redis = LocalRedisServer(tmp_path_factory.mktemp("redis")).start()
    cfg = WorkerConfig(role="colocated", worker_id="colo-0", model="smollm2-135m-instruct", redis_url=redis.url,
                       heartbeat_s=0.5, cache=CacheConfig(block_size=16, num_blocks=200),
                       scheduler=SchedulerConfig(max_num_batched_tokens=24, max_model_len=512))
    host = create_colocated_worker(cfg)
    host.start()
    router = RouterServer(RouterConfig(model="smollm2-135m-instruct", model_path=str(resolve_model("smollm2-135m-instruct")), redis_url=redis.url, port=0,
                                       max_model_len=512, view_period_s=0.1))
    address = router.start()
    with PdclusterClient(address, timeout_s=120) as client:
        client.wait_ready(30)
        deadline = time.monotonic() + 10
        while not router.view.workers("colocated"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield host, client, router.core.load
    router.stop()
    host.stop()
    redis.stop()


def _assert_no_leak(host, timeout_s=2.0):
    deadline = time.monotonic() + timeout_s
    while True:
        load = host.scheduler.load()
        if load["num_free_blocks"] == load["num_total_blocks"] and not load["num_running"]:
            return
        assert time.monotonic() < deadline, f"blocks still held: {load}"
        time.sleep(0.05)


def test_colocated_token_exact_with_chunked_prefill(colocated, hf_model, tokenizer):
    host, client, _ = colocated
    prompts = ["Explain what a KV cache is in two sentences.", "Give me three names for a cat.",
               "What is 17 times 23?", "Write a short poem about autumn leaves and rain."]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: client.generate([{"role": "user", "content": p}], max_tokens=16,
                                                          temperature=0), prompts))
    for p, res in zip(prompts, results):
        ids = render_chat(tokenizer, [{"role": "user", "content": p}])
        assert len(ids) > 24  # every prompt spans several 24-token prefill chunks
        ref, gaps = hf_greedy(hf_model, ids, 16)
        assert_greedy_matches(res.token_ids, ref, gaps, label=p)
    assert host.scheduler.prefill.pool.num_free == host.scheduler.prefill.pool.num_usable  # never allocates
    _assert_no_leak(host)


def test_colocated_abort_and_disconnect(colocated):
    host, client, load = colocated
    stream = client.stream("Tell me a long story.", max_tokens=300, ignore_eos=True, temperature=0,
                           request_id="colo-abort")
    it = iter(stream)
    next(it)
    assert client.abort("colo-abort")
    assert list(it)[-1].finish_reason == 3
    streams = [client.stream([9] * 200, max_tokens=20) for _ in range(4)]
    time.sleep(0.05)
    for s in streams:
        s.cancel()
    _assert_no_leak(host)
    with pytest.raises(grpc.RpcError) as exc:
        client.generate("hi", max_tokens=0)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _assert_no_leak(host)
    deadline = time.monotonic() + 2  # the router's own count of the worker's load is back to zero
    while load.in_flight("colo-0") or load.queued_tokens("colo-0"):
        assert time.monotonic() < deadline, (load.in_flight("colo-0"), load.queued_tokens("colo-0"))
        time.sleep(0.05)


def test_colocated_serves_structured_outputs(colocated):
    """The colocated worker compiles a constraint on both of its services (prefill: the first token;
    decode: the rest)."""
    host, client, _ = colocated
    res = client.generate("Pick a colour:", structured_outputs={"choice": [" crimson red", " ocean blue"]},
                          max_tokens=12, temperature=0)
    assert res.text in (" crimson red", " ocean blue") and res.finish_reason == "STOP", res
    _assert_no_leak(host)
