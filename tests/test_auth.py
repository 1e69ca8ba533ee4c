"""Authentication on a real local cluster started with two API keys: requests without a valid key
are refused (gRPC UNAUTHENTICATED, HTTP 401 / ``openai.AuthenticationError``) and nothing is
queued; with either key greedy output is token-exact with HF on both front doors; a key aborts only
its own requests; worker RPCs and KV pushes without the cluster secret are refused before anything
is allocated or written; health answers without credentials; ``top``, ``loadtest`` (both backends) and Prometheus use the key."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from functools import partial

import grpc
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.prometheus_server import PrometheusServer, find_prometheus
from kvtransfer import GrpcKvSender, KvTransferError
from pdcluster.cli import main as cli_main
from pdcluster.client import PdclusterClient
from pdcluster.top import scrape
from pdcluster.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from serving.registry import WorkerRegistry
from serving.security import SecurityConfig, internal_channel

from cluster_utils import (
    assert_greedy_matches,
    assert_no_leak,
    hf_greedy,
    render_chat,
    router_client,
    running_cluster,
    worker_channel,
    worker_loads,
)

MODEL = "smollm2-135m-instruct"
KEYS = ("k1", "k2")
BAD_KEYS = (None, "wrong", "k1k2", "k")
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--api-key", KEYS[0], "--api-key", KEYS[1],
                         "--max-model-len", "512", "--num-kv-blocks", "300", "--heartbeat-s", "0.5",
                         "--allowed-origins", "https://ui.example") as state:
        yield state


@pytest.fixture(autouse=True)
def _leak_check(request):
    yield
    if "cluster" in request.fixturenames:
        assert_no_leak(request.getfixturevalue("cluster"), timeout_s=5.0)


def _router_counts(state) -> dict[str, float]:
    """What the router has queued, running and seen, from its /metrics (read with a key)."""
    s = scrape(state["router_http_address"], {}, api_key=KEYS[0])
    names = ("num_requests_waiting", "num_requests_running", "request_success_total", "request_errors_total",
             "e2e_request_latency_seconds_count")
    return {name: s.total(name) for name in names}


def _without_key(state, path: str) -> tuple[int, dict]:
    body = json.dumps({"model": MODEL, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 64}).encode() if path != "/v1/models" else None
    request = urllib.request.Request(f"http://{state['router_http_address']}{path}", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _worker(state, role: str) -> dict:
    (w,) = [w for w in state["workers"] if w["role"] == role]
    return w


def _sampling(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, repetition_penalty=1.0)


def test_health_answers_without_credentials(cluster):
    with router_client(cluster):  # wait_ready: grpc.health.v1 on the router, no key
        pass
    with urllib.request.urlopen(f"http://{cluster['router_http_address']}/health", timeout=10) as r:
        assert r.status == 200
    preflight = urllib.request.Request(  # a browser's CORS preflight carries no key (up --allowed-origins)
        f"http://{cluster['router_http_address']}/v1/chat/completions", method="OPTIONS", headers={
            "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
    with urllib.request.urlopen(preflight, timeout=10) as r:
        assert r.status == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    kv = {i.worker_id: i.kv_endpoint for i, _ in WorkerRegistry(cluster["redis_url"], cluster["cluster"]).live_workers()}
    for address in [w["address"] for w in cluster["workers"]] + [e for e in kv.values() if e]:
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING, address


def test_requests_without_a_valid_key_are_refused_and_nothing_is_queued(cluster):
    before = _router_counts(cluster)
    for key in BAD_KEYS:
        with PdclusterClient(cluster["router_address"], timeout_s=30, api_key=key) as client:
            calls = (client.model_info, lambda: client.abort("r"),
                     lambda: client.generate("Once upon a time", max_tokens=64),
                     lambda: list(client.stream("Once upon a time", max_tokens=64)))
            for call in calls:
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == UNAUTHENTICATED, key
        if key is None:  # the openai SDK always sends one
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
                status, body = _without_key(cluster, path)
                assert status == 401 and body["error"]["type"] == "authentication_error", (path, body)
            continue
        with openai.OpenAI(base_url=f"http://{cluster['router_http_address']}/v1", api_key=key,
                           max_retries=0, timeout=30) as oai:
            for call in (oai.models.list,
                         lambda: oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=64),
                         lambda: list(oai.chat.completions.create(
                             model=MODEL, max_tokens=64, stream=True,
                             messages=[{"role": "user", "content": "Hi"}]))):
                with pytest.raises(openai.AuthenticationError) as refused:
                    call()
                body = refused.value.body
                body = body if isinstance(body, dict) and "message" in body else body["error"]
                assert refused.value.status_code == 401 and body["type"] == "authentication_error", body
    after = _router_counts(cluster)
    assert after == before and after["num_requests_waiting"] == after["num_requests_running"] == 0, (before, after)
    assert all(w.num_free_blocks == w.num_total_blocks and not w.num_running and not w.num_waiting
               for w in worker_loads(cluster))


def test_with_either_key_both_front_doors_are_token_exact(cluster, hf_model, tokenizer):
    prompt = "The three primary colors are"
    ids = tokenizer.encode(prompt)
    ref, gaps = hf_greedy(hf_model, ids, 16)
    chat = [{"role": "user", "content": "Name three rivers in Europe."}]
    chat_ref, chat_gaps = hf_greedy(hf_model, render_chat(tokenizer, chat), 16)
    with router_client(cluster, api_key=KEYS[0]) as client:
        res = client.generate(ids, max_tokens=16, temperature=0)
        chat_res = client.generate(chat, max_tokens=16, temperature=0)
    assert_greedy_matches(res.token_ids, ref, gaps, label=prompt)
    assert_greedy_matches(chat_res.token_ids, chat_ref, chat_gaps, label="chat")
    with openai.OpenAI(base_url=f"http://{cluster['router_http_address']}/v1", api_key=KEYS[1], max_retries=0,
                       timeout=300) as oai:
        text = oai.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0).choices[0].text
        chat_text = oai.chat.completions.create(model=MODEL, messages=chat, max_tokens=16,
                                                temperature=0).choices[0].message.content
    assert (text, chat_text) == (res.text, chat_res.text)


def test_abort_ends_only_requests_started_with_the_same_key(cluster):
    """Any valid key could abort any request id; another key's requests are now not found."""
    with router_client(cluster, api_key=KEYS[0]) as mine, router_client(cluster, api_key=KEYS[1]) as other:
        it = iter(mine.stream("Tell me a long story.", max_tokens=200, temperature=0, ignore_eos=True,
                              request_id="owned"))
        next(it)
        assert not other.abort("owned")
        next(it)  # still streaming
        assert mine.abort("owned")
        assert list(it)[-1].finish_reason == 3  # ABORT


def test_worker_rpcs_without_the_cluster_secret_are_refused_before_anything_is_allocated(cluster, tokenizer):
    request = worker_pb2.WorkerRequest(request_id=f"intruder-{uuid.uuid4().hex[:6]}",
                                       prompt_token_ids=tokenizer.encode("An unauthenticated prompt " * 8),
                                       sampling=_sampling(64))
    decode, prefill = _worker(cluster, "decode")["address"], _worker(cluster, "prefill")["address"]
    wrong_secret = partial(internal_channel, SecurityConfig(cluster_secret=KEYS[0]))  # an API key is no secret
    for connect in (grpc.insecure_channel, wrong_secret):
        d, p = worker_pb2_grpc.DecodeWorkerStub(connect(decode)), worker_pb2_grpc.PrefillWorkerStub(connect(prefill))
        calls = (lambda: next(d.Reserve(worker_pb2.ReserveRequest(request=request, transfer_id="t"), timeout=30)),
                 lambda: p.Prefill(worker_pb2.PrefillRequest(request=request, transfer_id="t"), timeout=30),
                 lambda: d.GetLoad(worker_pb2.GetLoadRequest(), timeout=10),
                 lambda: p.Abort(worker_pb2.WorkerAbortRequest(request_id=request.request_id), timeout=10))
        for call in calls:
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == UNAUTHENTICATED and "cluster secret" in refused.value.details()
    loads = worker_loads(cluster)  # with the secret
    assert len(loads) == 2 and all(w.num_free_blocks == w.num_total_blocks and not w.num_running
                                   and not w.num_waiting for w in loads)


def test_kv_push_without_the_secret_is_refused_and_the_reservation_survives(cluster, model_config, hf_model,
                                                                             tokenizer):
    """A reservation made (with the secret) on the decode worker; a push of junk KV into it without
    the secret is refused before the receiver runs (nothing written, no transfer failed); the real
    prefill then completes it and the tokens are token-exact."""
    ids = tokenizer.encode("On the slow river the ferryman counted the lanterns of the sleeping town. " * 3)[:40]
    request = worker_pb2.WorkerRequest(request_id=f"kv-{uuid.uuid4().hex[:6]}", prompt_token_ids=ids,
                                       sampling=_sampling(8))
    decode = worker_pb2_grpc.DecodeWorkerStub(worker_channel(cluster, _worker(cluster, "decode")["address"]))
    prefill = worker_pb2_grpc.PrefillWorkerStub(worker_channel(cluster, _worker(cluster, "prefill")["address"]))
    tid = uuid.uuid4().hex
    events = decode.Reserve(worker_pb2.ReserveRequest(request=request, transfer_id=tid), timeout=120)
    dest = next(events).reservation
    before = decode.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    junk = torch.full((model_config.num_layers, 2, 4, 16, model_config.num_kv_heads, model_config.head_dim), 1e4)
    wrong_secret = partial(internal_channel, SecurityConfig(cluster_secret=KEYS[1]))
    for sender in (GrpcKvSender(timeout_s=30), GrpcKvSender(timeout_s=30, connect=wrong_secret)):
        with pytest.raises(KvTransferError, match="UNAUTHENTICATED") as refused:
            sender.send(request.request_id, tid, dest, junk, [0, 1, 2], 7, layers_per_chunk=model_config.num_layers)
        sender.close()
        assert "cluster secret" in refused.value.reason
    after = decode.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    assert (after.num_free_blocks, after.num_failed_transfers) == (before.num_free_blocks, before.num_failed_transfers)
    prefill.Prefill(worker_pb2.PrefillRequest(request=request, transfer_id=tid, destination=dest), timeout=120)
    tokens = [t for ev in events for t in ev.tokens.token_ids]
    ref, gaps = hf_greedy(hf_model, ids, 8)
    assert_greedy_matches(tokens, ref, gaps, label="reservation after a refused push")


def test_top_and_loadtest_send_the_key(cluster, tmp_path, capsys):
    http = cluster["router_http_address"]
    assert cli_main(["top", "--address", http, "--iterations", "1", "--interval", "0.1"]) == 1
    assert "401" in capsys.readouterr().err
    assert cli_main(["top", "--address", http, "--api-key", KEYS[0], "--iterations", "1", "--interval", "0.1"]) == 0
    common = ["--workload", "synthetic", "--num-requests", "3", "--rate", "10", "--input-len", "16",
              "--output-len", "4", "--no-plots", "--no-progress", "--duration", "60"]
    assert cli_main(["loadtest", "--address", cluster["router_address"], *common]) == 1  # no key: refused
    for backend, target, key in (("grpc", ["--address", cluster["router_address"]], KEYS[0]),
                                 ("openai", ["--base-url", f"http://{http}"], KEYS[1])):
        out = tmp_path / backend
        assert cli_main(["loadtest", "--backend", backend, *target, "--api-key", key, *common,
                         "--output-dir", str(out)]) == 0, backend
        summary = (out / "summary.json").read_text()
        assert '"completed": 3' in summary and f'"{key}"' not in summary


@pytest.mark.skipif(find_prometheus() is None, reason="Debian's prometheus package is not installed")
def test_prometheus_discovers_and_scrapes_with_the_key(cluster, tmp_path):
    prom = PrometheusServer(cluster["router_http_address"], tmp_path / "prometheus", api_key=KEYS[1]).start()
    try:
        deadline = time.monotonic() + 60
        while True:
            up = {r["metric"].get("role"): r["value"][1] for r in prom.query("up")}
            if up == {"router": "1", "prefill": "1", "decode": "1"}:
                break
            assert time.monotonic() < deadline, up
            time.sleep(0.5)
    finally:
        prom.stop()
