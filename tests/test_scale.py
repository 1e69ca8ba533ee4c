"""Live scaling: draining workers and ``pdcluster scale``.

* ``WorkerHost.drain`` on a decode worker with a request in flight (real workers, router
  and Redis in this process): the registry shows it draining at once, new requests go
  elsewhere, the in-flight one finishes token-exact, then it deregisters; nothing leaks.
* ``scale`` on a real local Ray cluster: 1+1 -> 2+2 -> 1+1 while a stream of 30 greedy
  requests runs; all 30 complete token-exact (compared with the same requests before
  scaling), the removed workers drained and deregistered, nothing leaks.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from decode_worker.worker import create_decode_worker
from deploy.redis_server import LocalRedisServer
from deploy.scale import ScaleTarget, plan, scale, scale_from_state_dir
from deploy.state import read_state, state_path
from engine.config import CacheConfig, SchedulerConfig
from engine.model_loader import resolve_model
from pdcluster.client import PdclusterClient
from prefill_worker.worker import create_prefill_worker
from router.server import RouterConfig, RouterServer
from serving.registry import WorkerRegistry
from serving.worker_config import WorkerConfig

from cluster_utils import assert_greedy_matches, assert_no_leak, hf_greedy, render_chat, running_cluster, worker_loads

MODEL = "smollm2-135m-instruct"


def test_plan_removes_newest_and_never_reuses_ids():
    state = {"workers": [{"worker_id": w, "role": w.split("-")[0]} for w in
                         ("prefill-0", "prefill-2", "decode-0", "decode-1")],
             "next_index": {"prefill": 3, "decode": 2, "colocated": 0}}
    add, remove = plan(state, ScaleTarget(prefill=1, decode=3))
    assert add == [("decode", "decode-2")]
    assert [w["worker_id"] for w in remove] == ["prefill-2"]
    add, _ = plan(state, ScaleTarget(prefill=4))
    assert add == [("prefill", "prefill-3"), ("prefill", "prefill-4")]
    with pytest.raises(ValueError, match="at least one prefill"):
        plan(state, ScaleTarget(decode=0))
    with pytest.raises(ValueError, match="colocated"):
        plan(state, ScaleTarget(colocated=2))


@pytest.fixture(scope="module")
def in_process_cluster(tmp_path_factory):
    """Redis, one prefill and two decode workers, and a router, all in this process."""
    redis = LocalRedisServer(tmp_path_factory.mktemp("redis")).start()
    base = dict(model=MODEL, redis_url=redis.url, cluster="drain", heartbeat_s=0.3,
                cache=CacheConfig(block_size=16, num_blocks=200), scheduler=SchedulerConfig(max_model_len=512))
    hosts = {"prefill-0": create_prefill_worker(WorkerConfig(role="prefill", worker_id="prefill-0", **base))}
    for wid in ("decode-0", "decode-1"):
        hosts[wid] = create_decode_worker(WorkerConfig(role="decode", worker_id=wid, **base))
    for h in hosts.values():
        h.start()
    router = RouterServer(RouterConfig(model=MODEL, model_path=str(resolve_model(MODEL)), redis_url=redis.url, cluster="drain", port=0,
                                       max_model_len=512, view_period_s=0.075))
    address = router.start()
    try:
        with PdclusterClient(address, timeout_s=120) as client:
            client.wait_ready(30)
            yield hosts, client, WorkerRegistry(redis.url, "drain")
    finally:
        router.stop()
        for h in hosts.values():
            h.stop()
        redis.stop()


def _all_free(hosts) -> bool:
    return all((lambda ld: ld["num_free_blocks"] == ld["num_total_blocks"] and not ld["num_running"])(
        h.scheduler.load()) for h in hosts.values())


def test_drain_finishes_in_flight_request_then_deregisters(in_process_cluster, hf_model, tokenizer):
    hosts, client, registry = in_process_cluster
    ids = render_chat(tokenizer, [{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
    ref, gaps = hf_greedy(hf_model, ids, 40)
    tokens: list[int] = []
    stream = client.stream(ids, max_tokens=40, temperature=0)
    it = iter(stream)
    tokens.extend(next(it).token_ids)
    victim = next(wid for wid, h in hosts.items() if wid.startswith("decode") and h.scheduler.load()["num_running"])
    survivor = ({"decode-0", "decode-1"} - {victim}).pop()
    finished_before = hosts[victim].scheduler.load()["num_finished"]
    result: dict = {}
    drainer = threading.Thread(target=lambda: result.update(hosts[victim].drain(timeout_s=60)))
    drainer.start()
    deadline = time.monotonic() + 5
    while not any(i.worker_id == victim and ld.draining for i, ld in registry.live_workers()):
        assert time.monotonic() < deadline, "the registry never showed the worker draining"
        time.sleep(0.02)
    time.sleep(0.2)  # the router's view refreshes every 75 ms
    new = [client.generate(f"Say {i}.", max_tokens=4, temperature=0) for i in range(3)]
    assert all(r.usage.completion_tokens == 4 for r in new)
    for chunk in it:  # the in-flight request keeps streaming from the draining worker
        tokens.extend(chunk.token_ids)
    assert_greedy_matches(tokens, ref, gaps, label="request in flight during drain")
    drainer.join(timeout=60)
    assert result["drained"] and result["num_running"] == 0, result
    assert hosts[victim].scheduler.load()["num_finished"] == finished_before + 1, "the drained worker got new work"
    assert victim not in {i.worker_id for i, _ in registry.live_workers()}
    assert survivor in {i.worker_id for i, _ in registry.live_workers()}
    deadline = time.monotonic() + 2
    while not _all_free(hosts):
        assert time.monotonic() < deadline, {w: h.scheduler.load() for w, h in hosts.items()}
        time.sleep(0.05)


PROMPTS = [f"Count from {i} to {i + 6}, then name a city that starts with the letter {chr(65 + i % 26)}."
           for i in range(30)]
MAX_NEW = 16


def _run_all(client, prompts, results: dict, pool_size: int = 3, gate=None) -> None:
    """Greedy requests, ``pool_size`` at a time; ``gate(i)`` blocks until prompt i may start."""
    def one(i):
        if gate:
            gate(i)
        results[i] = list(client.generate(prompts[i], max_tokens=MAX_NEW, temperature=0, ignore_eos=True).token_ids)

    with ThreadPoolExecutor(pool_size) as pool:
        list(pool.map(one, range(len(prompts))))


def _writer(state_dir):
    return lambda s: state_path(state_dir).write_text(json.dumps(s, indent=2))


def test_scale_up_and_down_while_serving(tmp_path):
    with running_cluster(tmp_path, "--prefill", "1", "--decode", "1", "--worker-cpus", "0.5",
                         "--num-kv-blocks", "200", "--max-model-len", "256", "--heartbeat-s", "0.5") as state:
        with PdclusterClient(state["router_address"], timeout_s=300) as client:
            client.wait_ready(30)
            baseline: dict = {}
            _run_all(client, PROMPTS, baseline)

            # The stream: 10 requests while scaling up, 10 on 2+2 (scaling down starts while
            # the added decode worker runs one of them), 10 released while the removed
            # workers drain.
            phase = [threading.Event(), threading.Event()]
            results: dict = {}
            gate = lambda i: phase[i // 10 - 1].wait(600) if i >= 10 else None  # noqa: E731
            stream = threading.Thread(target=_run_all, args=(client, PROMPTS, results, 3, gate))
            stream.start()
            try:
                up = scale_from_state_dir(tmp_path, ScaleTarget(prefill=2, decode=2))
                assert sorted(up["last_scale"]["added"]) == ["decode-1", "prefill-1"]
                assert read_state(tmp_path)["workers"] == up["workers"]
                phase[0].set()
                # connected beforehand, so the drain starts right after the check below
                ray.init(address=state["ray_address"], namespace="pdcluster", logging_level="WARNING")
                deadline = time.monotonic() + 120
                while not any(w.worker_id == "decode-1" and w.num_running for w in worker_loads(up)):
                    assert time.monotonic() < deadline, "the added decode worker never got a request"
                    time.sleep(0.02)
                phase[1].set()  # released while the removed workers drain
                down = scale(up, ScaleTarget(prefill=1, decode=1), on_change=_writer(tmp_path))
            finally:
                for event in phase:
                    event.set()
                ray.shutdown()
            stream.join(timeout=600)
            assert not stream.is_alive()

        report = down["last_scale"]["removed"]
        assert sorted(report) == ["decode-1", "prefill-1"]
        assert all(r["drained"] for r in report.values()), report
        start = report["decode-1"]["at_start"]
        assert start["num_running"] + start["active_rpcs"] >= 1, f"nothing was in flight on decode-1: {report}"
        assert sorted(results) == list(range(30))
        for i in range(30):
            assert results[i] == baseline[i], f"request {i} differs after scaling: {results[i]} != {baseline[i]}"
        live = {w.worker_id for w, _ in WorkerRegistry(state["redis_url"], state["cluster"]).live_workers()}
        assert live == {"prefill-0", "decode-0"}
        final = read_state(tmp_path)
        assert sorted(w["worker_id"] for w in final["workers"]) == ["decode-0", "prefill-0"]
        assert final["placement_groups"] == [state["placement_groups"][0]], "the emptied group was not removed"
        assert_no_leak(final)


def test_a_failed_drain_is_said_in_words():
    """``scale``'s warning for a removed worker says why its drain did not finish (helper finding: a raw
    dict, and "did not drain in time" for a worker that had died)."""
    from deploy.scale import _drain_failure

    died = _drain_failure({"drained": False, "error": "ActorDiedError: The actor died unexpectedly\ntraceback"})
    assert died == "its drain failed (ActorDiedError: The actor died unexpectedly): it died or stopped answering"
    late = _drain_failure({"drained": False, "waited_s": 30.02, "num_running": 2, "num_waiting": 0, "active_rpcs": 3})
    assert late == "--drain-timeout-s ran out after 30.0 s with 2 running, 0 waiting, 3 active rpcs"
