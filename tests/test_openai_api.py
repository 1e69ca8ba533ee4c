"""The OpenAI-compatible HTTP API of a real local cluster, through the official ``openai`` package
(sync and async, stream and not, chat and completions, n=2, logprobs, seed, stop), token-exact
with the gRPC path for greedy requests; errors in OpenAI's shape; a cancelled stream frees both
workers' blocks; health and metrics endpoints."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from cluster_utils import assert_no_leak, router_client, running_cluster

from pdcluster.top import scrape

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Name three rivers in Europe."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--max-model-len", "512", "--num-kv-blocks", "400",
                         "--heartbeat-s", "0.5") as state:
        yield state


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with router_client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def base_url(cluster, grpc_client):
    return f"http://{cluster['router_http_address']}"


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(autouse=True)
def _leak_check(request):
    yield
    if "cluster" in request.fixturenames:
        assert_no_leak(request.getfixturevalue("cluster"), timeout_s=5.0)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_models_health_metrics(oai, base_url):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert _get(f"{base_url}/health")[0] == 200
    status, body = _get(f"{base_url}/metrics")
    assert status == 200 and b"pdcluster:time_to_first_token_seconds" in body
    status, body = _get(f"{base_url}/v1/prometheus/targets")
    roles = {g["labels"]["role"] for g in json.loads(body)}
    assert status == 200 and roles == {"router", "prefill", "decode"}


def test_completion_greedy_equals_grpc(oai, grpc_client):
    ref = grpc_client.generate("The capital of France is", max_tokens=24, temperature=0)
    got = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0)
    assert got.choices[0].text == ref.text
    assert got.choices[0].finish_reason == ref.finish_reason.lower()
    assert got.usage.prompt_tokens == ref.usage.prompt_tokens
    assert got.usage.completion_tokens == len(ref.token_ids)
    tokens = oai.completions.create(model=MODEL, prompt=list(grpc_client.generate("x", max_tokens=1).token_ids) * 3,
                                    max_tokens=4, temperature=0)
    assert tokens.usage.prompt_tokens == 3


def test_chat_stream_equals_grpc_stream(oai, grpc_client):
    ref = "".join(c.text for c in grpc_client.stream(CHAT, max_tokens=32, temperature=0))
    chunks = list(oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    whole = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0)
    assert whole.choices[0].message.content == ref and whole.object == "chat.completion"
    running = list(oai.chat.completions.create(  # vLLM's continuous usage (helper finding: silently ignored)
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in running[:-1]]
    assert counts == sorted(counts) and counts[-1] == 8 and running[-1].usage.completion_tokens == 8, counts
    assert {c.usage.prompt_tokens for c in running} == {chunks[-1].usage.prompt_tokens}


def test_async_client_and_parts(base_url):
    async def go():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as c:
            parts = [{"role": "user", "content": [{"type": "text", "text": "Name three rivers in Europe."}]}]
            a = await c.chat.completions.create(model=MODEL, messages=parts, max_tokens=16, temperature=0)
            b = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
            stream = await c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                                                stream=True)
            text = "".join([ch.choices[0].text async for ch in stream])
            return a, b, text
    a, b, text = asyncio.run(go())
    assert a.choices[0].message.content == b.choices[0].message.content
    assert text


def test_n2_logprobs_seed_stop(oai):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, n=2, logprobs=True,
                                    top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: identical samples
    assert r.usage.prompt_tokens_details.cached_tokens >= 16  # the second sample reused the first's prefill
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens // 2 and all(len(t.top_logprobs) == 3 for t in lp)
    assert lp[0].logprob == pytest.approx(lp[0].top_logprobs[0].logprob)
    c = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.tokens) == 6 and all(len(t) <= 2 for t in c.choices[0].logprobs.top_logprobs)
    z = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=0)
    zl = z.choices[0].logprobs  # logprobs 0: the sampled tokens' logprobs, each top list only the sampled token
    assert zl.tokens == c.choices[0].logprobs.tokens and zl.token_logprobs == c.choices[0].logprobs.token_logprobs
    assert zl.top_logprobs == [{t: lp} for t, lp in zip(zl.tokens, zl.token_logprobs)]
    h = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.5, seed=3,
                               logprobs=1).choices[0].logprobs  # sampled: the token is not always the top one
    assert all(top.get(t) == lp and len(top) <= 2 for t, lp, top in zip(h.tokens, h.token_logprobs, h.top_logprobs))
    s1 = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7)
    s2 = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7)
    assert s1.choices[0].text == s2.choices[0].text
    full = oai.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=16, temperature=0)
    word = full.choices[0].text.split()[1]
    cut = oai.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=16, temperature=0,
                                 stop=[word])
    assert word not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].stop_reason == word and full.choices[0].stop_reason is None  # vLLM's field
    chunks = list(oai.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=16, temperature=0,
                                         stop=[word], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text
    assert all(c.choices[0].text or c.choices[0].finish_reason for c in chunks)  # held-back text: no empty chunks
    assert chunks[-1].choices[0].stop_reason == word


@pytest.mark.parametrize("kwargs, status, param", [
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"max_tokens": 10_000}, 400, None),
    ({"n": 0}, 400, "n"),
    ({"logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ({"model": "no-such-model"}, 404, "model"),
])
def test_errors_in_openai_shape(oai, kwargs, status, param):
    args = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        oai.completions.create(**args)
    err = info.value
    assert err.status_code == status
    body = err.body if isinstance(err.body, dict) and "message" in err.body else err.body["error"]
    assert body["message"] and body["type"]
    if param:
        assert body["param"] == param, body


BAD_BODIES = [
    ("completions", '"temperature": NaN', "temperature"),
    ("completions", '"top_p": Infinity', "top_p"),
    ("completions", '"presence_penalty": -Infinity', "presence_penalty"),
    ("completions", '"min_p": -0.5', "min_p"),
    ("completions", '"top_k": -2', "top_k"),
    ("completions", '"logit_bias": {"5": NaN}', "logit_bias"),
    ("completions", '"logit_bias": {"-1": 1}', "logit_bias"),
    ("completions", '"stop_token_ids": [49152]', "stop_token_ids"),
    ("completions", '"stop_token_ids": [-1]', "stop_token_ids"),
    ("completions", '"stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]',
     "stop"),
    ("completions", '"logprobs": 21', "logprobs"),
    ("completions", '"stream_options": {"include_usage": true}', "stream_options"),  # without stream
    ("completions", '"prompt": [1, 49152]', "prompt"),
    ("completions", f'"prompt": "{"x" * 100_000}"', "prompt"),
    ("chat/completions", '"messages": [{"role": "robot", "content": "hi"}]', "messages[0].role"),
    # strict JSON types (lax parsing would read true as 1 and "0.5" as 0.5)
    ("completions", '"max_tokens": true', "max_tokens"),
    ("completions", '"temperature": "0.5"', "temperature"),
    ("completions", '"stream": "yes"', "stream"),
    ("completions", '"prompt": {"a": 1}', "prompt"),  # fits none of its forms: named without union tags
    ("completions", '"stop_token_ids": [1, false]', "stop_token_ids[1]"),
    ("completions", '"max_tokens": 100000000', "max_tokens"),
    ("chat/completions", '"messages": [{"role": "user", "content": null}]', "messages[0].content"),
    ("chat/completions", '"messages": [{"role": "user"}]', "messages[0].content"),
    ("chat/completions", '"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 100000000',
     "max_completion_tokens"),
    ("chat/completions", '"messages": [' + ", ".join(['{"role": "user", "content": "x"}'] * 257) + "]",
     "messages"),
    ("chat/completions", '"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5',
     "max_completion_tokens"),
    ("chat/completions", '"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]',
     "messages[0].content"),
    ("completions", '"top_p": 1e-300', "top_p"),  # rounds to 0 in float32: refused as too small
    # too large for the wire: named as the request wrote it (chat's top_logprobs is the router's logprobs)
    ("chat/completions", '"logprobs": true, "top_logprobs": 1099511627776', "top_logprobs"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BAD_BODIES,
                         ids=[f"{param}-{i}" for i, (_, _, param) in enumerate(BAD_BODIES)])
def test_bad_values_are_400_naming_the_field(base_url, path, fields, param):
    """NaN, infinities, negatives, token ids outside the vocabulary and limits: refused as on gRPC."""
    prompt = "" if '"prompt"' in fields or '"messages"' in fields else (
        '"prompt": "hi", ' if path == "completions" else '"messages": [{"role": "user", "content": "hi"}], ')
    body = f'{{"model": "{MODEL}", "max_tokens": 2, {prompt}{fields}}}'.encode()
    req = urllib.request.Request(f"{base_url}/v1/{path}", data=body, headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    error = json.loads(info.value.read())["error"]
    assert info.value.code == 400 and error["param"] == param, error


def test_unreadable_bodies_are_400_saying_why(base_url):
    def post(data: bytes, headers: dict, method: str = "POST") -> tuple[int, dict]:
        req = urllib.request.Request(f"{base_url}/v1/chat/completions", data=data, headers=headers, method=method)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        return info.value.code, json.loads(info.value.read())["error"]

    status, error = post(f'{{"model": "{MODEL}",'.encode(), {"content-type": "application/json"})
    assert status == 400 and error["code"] == "invalid_json" and error["param"] is None, error
    assert error["message"].startswith("the request body is not valid JSON at character"), error
    for body, reason in ((b'{"model": "\xff"}', "not valid UTF-8"), (b'{"n": ' + b"9" * 5000 + b"}", "digits"),
                         (b"[" * 100000 + b"]" * 100000, "nested too deeply")):
        status, error = post(body, {"content-type": "application/json"})
        assert status == 400 and error["code"] == "invalid_json", error
        assert error["message"].startswith("the request body is not valid JSON: ") and reason in error["message"]
    status, error = post(b"model=x", {"content-type": "application/x-www-form-urlencoded"})
    assert status == 400 and "Content-Type: application/json (got application/x-www-form-urlencoded)" in \
        error["message"], error
    status, error = post(None, {}, method="GET")
    assert status == 405 and error["type"] == "invalid_request_error" and error["code"] == "method_not_allowed"


def test_chat_errors(oai):
    with pytest.raises(openai.BadRequestError, match="image_url"):
        oai.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="messages is empty"):
        oai.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="messages: Field required") as info:  # as OpenAI: required
        oai.post("/chat/completions", cast_to=object, body={"model": MODEL, "max_tokens": 4})
    assert info.value.body["param"] == "messages", info.value.body
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={"unknown_field": 1})
    assert r.choices[0].message.content  # unknown fields are ignored


def test_what_a_vllm_user_expects(oai, grpc_client):
    """``null`` is a left-out field; a chat without ``max_tokens`` runs to its end, not to 16 tokens;
    a stop token's text is left out of the text unless ``include_stop_str_in_output``, which also
    keeps a stop string; ``/v1/models/{id}``; a sampling field's message names it as the body did."""
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], temperature=0,
                                    n=None, stream=None, logprobs=None, seed=None, stop=None)
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens > 0
    c = oai.completions.create(model=MODEL, prompt="Once", max_tokens=2, echo=None, n=None, logprobs=None)
    assert len(c.choices) == 1 and c.usage.completion_tokens == 2
    long = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a story."}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length"
    assert long.usage.completion_tokens + long.usage.prompt_tokens == 512  # the cluster's max_model_len
    prompt = "1, 2, 3, 4, 5,"
    ref = grpc_client.generate(prompt, max_tokens=3, temperature=0)  # " ", "6", ","
    assert ref.text == " 6,", ref.text
    comma = ref.token_ids[-1]
    for extra, text in (({}, " 6"), ({"include_stop_str_in_output": True}, " 6,")):
        for stream in (False, True):
            got = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=stream,
                                         extra_body={"stop_token_ids": [comma], **extra})
            got = list(got) if stream else got
            out = "".join(ch.choices[0].text for ch in got) if stream else got.choices[0].text
            assert out == text, (extra, stream, out)
            last = got[-1] if stream else got
            assert (last.choices[0].finish_reason, last.choices[0].stop_reason) == ("stop", comma)
            assert stream or got.usage.completion_tokens == 3
    kept = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[" 7"],
                                  extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == " 6, 7" and kept.choices[0].finish_reason == "stop"
    raw = oai.completions.with_raw_response.create(model=MODEL, prompt="Once", max_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id
    streamed = oai.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True)
    assert streamed.headers["x-request-id"] == next(iter(streamed.parse())).id
    mine = oai.completions.with_raw_response.create(model=MODEL, prompt="Once", max_tokens=2,
                                                    extra_headers={"X-Request-Id": "trace-42"})
    assert mine.parse().id == mine.headers["x-request-id"] == "cmpl-trace-42"  # vLLM's naming (helper finding)
    with pytest.raises(openai.BadRequestError, match="X-Request-Id header must be 1 to 128 printable"):
        oai.completions.create(model=MODEL, prompt="Once", max_tokens=2, extra_headers={"X-Request-Id": "a b"})
    short = oai.completions.create(model=MODEL, prompt="Write a long story about dragon number 1.", max_tokens=12,
                                   temperature=0, extra_body={"min_tokens": 5})
    assert short.usage.completion_tokens >= 5  # EOS at once without min_tokens (tests/test_e2e_sampling.py)
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
    with pytest.raises(openai.BadRequestError, match=r"400 - top_logprobs must be in \[0, 20\], got 21$"):
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=21)


def _router_totals(base_url: str) -> dict[str, float]:
    s = scrape(base_url.removeprefix("http://"), {})

    def errors(code: str) -> float:
        return sum(v for (n, labels), v in s.values.items() if n == "request_errors_total" and ("code", code) in labels)
    return {"ok": s.total("request_success_total"), "errors": s.total("request_errors_total"),
            "invalid": errors("INVALID_ARGUMENT"), "not_found": errors("NOT_FOUND"), "cancelled": errors("CANCELLED"),
            "generated": s.total("generation_tokens_total")}


def test_every_request_is_counted_once(cluster, oai, base_url):
    """Cancelled gRPC streams (whether the cancel finds the router waiting on the decode worker or
    handing a message to gRPC, which then never resumes the handler) and the HTTP layer's own
    refusals each count once in ``request_errors``; a cancelled stream's tokens count in
    ``generation_tokens``."""
    before = _router_totals(base_url)
    received = 0
    for i in range(8):
        with router_client(cluster) as client:  # the channel closes right after the cancel, as a client that exits
            stream = client.stream(f"Write a long story about dragon number {i}.", max_tokens=200, ignore_eos=True)
            for n, chunk in enumerate(stream, 1):
                received += len(chunk.token_ids)
                if n == 5:
                    stream.cancel()
                    break
    for body in ({"model": MODEL, "prompt": "hi", "max_tokens": "3"}, {"model": MODEL, "prompt": "hi", "suffix": "x"},
                 {"model": "no-such-model", "prompt": "hi"}):
        with pytest.raises(openai.APIStatusError):
            oai.post("/completions", cast_to=object, body=body)
    deadline = time.monotonic() + 10
    while True:
        after = _router_totals(base_url)
        if after["cancelled"] - before["cancelled"] >= 8 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    delta = {k: after[k] - before[k] for k in after}
    assert delta["cancelled"] == 8 and delta["invalid"] == 2 and delta["not_found"] == 1, (delta, received)
    assert delta["errors"] == 11 and delta["ok"] == 0, delta
    assert delta["generated"] >= received >= 40, delta


def test_cancelled_stream_frees_both_workers(cluster, oai):
    stream = oai.completions.create(model=MODEL, prompt="Write a long story about a dragon.", max_tokens=400,
                                    temperature=0, stream=True)
    got = 0
    for chunk in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    time.sleep(0.5)
    assert_no_leak(cluster, timeout_s=10.0)


def test_pdcluster_top_renders_every_process(oai, base_url):
    from rich.console import Console

    from pdcluster.top import run_top

    oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    console = Console(record=True, width=200, force_terminal=False)
    assert run_top(base_url, interval_s=0.3, iterations=2, console=console) == 0
    text = console.export_text()
    assert "prefill-0" in text and "decode-0" in text and "TTFT ms" in text
    assert "router-" in text  # each router's row names it (several with --routers N)
    assert text.endswith("\n")  # piped: the last frame ends its line too
    assert run_top("http://127.0.0.1:1", interval_s=0.1, iterations=1, console=console) == 1


def test_loadtest_openai_backend(base_url, tmp_path):
    from pdcluster.cli import main as cli_main

    rc = cli_main(["loadtest", "--backend", "openai", "--base-url", base_url, "--workload", "synthetic",
                   "--num-requests", "6", "--rate", "3", "--input-len", "48", "--output-len", "8",
                   "--output-dir", str(tmp_path), "--no-plots", "--no-progress", "--duration", "120"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 0 and summary["completed"] == 6 and summary["failed"] == 0, summary
    assert summary["total_output_tokens"] == 6 * 8 and summary["output_token_mismatches"] == 0
    for key in ("median_ttft_ms", "p99_itl_ms", "mean_e2el_ms", "total_token_throughput", "duration"):
        assert summary[key] is not None and summary[key] > 0, key


def test_vllm_shapes_sse_events_role_chunk_and_default_model(base_url):
    body = json.dumps({"messages": CHAT, "max_tokens": 3, "stream": True}).encode()  # no "model": the served one
    with urllib.request.urlopen(urllib.request.Request(f"{base_url}/v1/chat/completions", data=body, headers={
            "content-type": "application/json"}), timeout=60) as r:
        raw = r.read()
    events = raw.decode().split("\n\n")
    assert b"\r" not in raw and events[-2:] == ["data: [DONE]", ""], raw  # each event ends "\n\n", as vLLM's
    first = json.loads(events[0].removeprefix("data: "))
    assert first["model"] == MODEL and first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
